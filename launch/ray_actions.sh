# shellcheck shell=bash
# The Ray story for elastic mode (docs/elastic.md): a head CPU VM and a pool of spot TPU VMs.
#
# Sourced after common.sh, actions.sh and parse_flags. The head runs `ray start --head` (bound to
# its internal IP, dashboard off) and the elastic driver; the pool's TPU VMs are single TPU VMs
# NAME-0 .. NAME-<N-1> whose startup script (run on every boot, so also on a re-created VM)
# installs the pinned stack and keeps `ray start --address=HEAD:PORT` running under systemd.
# Ray has no authentication here: the firewall rule admits only the cluster's own VMs (its tag).

# Checks what every ray_*.sh script needs; dies before any gcloud call.
validate_ray() {
  validate_resource
  validate_train
  if uses_queued_resource; then
    die "--node-count=$NODE_COUNT/--queued: the Ray pool is --pool-size single TPU VMs, each" \
      "joining on its own; use --pool-size=N"
  fi
  { _is_count "$POOL_SIZE" && ((10#$POOL_SIZE >= 1)); } ||
    die "--pool-size=$POOL_SIZE: need a whole number >= 1 (spot TPU VMs in the pool)"
  POOL_SIZE=$((10#$POOL_SIZE))
  HEAD_NAME=${HEAD_NAME:-$NAME-head}
  [[ $HEAD_NAME =~ ^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$ ]] ||
    die "--head-name=$HEAD_NAME: use lowercase letters, digits and hyphens, starting with a letter"
  if [[ -n $HEAD_ADDRESS && ! $HEAD_ADDRESS =~ ^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$ ]]; then
    [[ $HEAD_ADDRESS == *:* ]] &&
      die "--head-address=$HEAD_ADDRESS: give the host only (IP or DNS name); the port is --ray-port"
    die "--head-address=$HEAD_ADDRESS: need an IP or a DNS name"
  fi
  { _is_count "$RAY_PORT" && ((10#$RAY_PORT >= 1 && 10#$RAY_PORT <= 65535)); } ||
    die "--ray-port=$RAY_PORT: need a port number"
  [[ $NODE_DIR =~ ^/[A-Za-z0-9_./-]+$ ]] ||
    die "--node-dir=$NODE_DIR: need an absolute path (the startup script runs as root)"
  NODE_DIR=${NODE_DIR%/}
  [[ $NETWORK =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] || die "--network=$NETWORK: not a network name"
  CODE_URL=${CODE_URL:-${WORKDIR%/}/code/dipaco_jax.tar.gz}
  [[ $CODE_URL == gs://?* ]] ||
    die "--code-url=$CODE_URL must be a gs:// object: a re-created VM fetches the code from it"
  RAY_TAG="$NAME-ray"
}

# Chips in the whole pool: one worker actor each (elastic workers run a path on one device).
pool_chips() {
  local gen=${ACCELERATOR_TYPE%-*} size=${ACCELERATOR_TYPE##*-}
  case $gen in
    v4 | v5p) echo $((POOL_SIZE * size / 2)) ;;
    *) echo $((POOL_SIZE * size)) ;;
  esac
}

pool_names() {
  local i
  for ((i = 0; i < POOL_SIZE; i++)); do echo "$NAME-$i"; done
}

# Runs a gcloud describe and prints what it prints; nothing when not found; dies on other errors.
gcloud_lookup() {
  local err out
  if ((DRY_RUN)); then
    run "$@"
    return 0
  fi
  err=$(mktemp)
  if out=$(run "$@" 2>"$err"); then
    rm -f "$err"
    printf '%s\n' "$out"
    return 0
  fi
  if grep -qi 'not.found\|was not found' "$err"; then
    rm -f "$err"
    return 0
  fi
  cat "$err" >&2
  rm -f "$err"
  die "gcloud could not describe ${*:3:2} (see above)"
}

instances() {
  local verb=$1 name=$2
  shift 2
  run gcloud compute instances "$verb" "$name" "--zone=$ZONE" "--project=$PROJECT" "$@"
}

# --- the firewall rule -------------------------------------------------------------------------

# Admits TCP between the cluster's VMs (tag NAME-ray) and nothing else: Ray's ports (GCS, raylets,
# object store, workers) are unauthenticated remote code execution for whoever reaches them.
ensure_firewall() {
  local found
  found=$(gcloud_lookup gcloud compute firewall-rules describe "$RAY_TAG" "--project=$PROJECT" \
    '--format=value(name)')
  if [[ -n $found ]]; then
    note "firewall rule $RAY_TAG exists: using it"
    return 0
  fi
  note "firewall rule $RAY_TAG: TCP between VMs tagged $RAY_TAG only"
  run gcloud compute firewall-rules create "$RAY_TAG" "--project=$PROJECT" "--network=$NETWORK" \
    --direction=INGRESS --action=ALLOW --rules=tcp "--source-tags=$RAY_TAG" \
    "--target-tags=$RAY_TAG"
}

# --- the startup script ------------------------------------------------------------------------

# Prints the startup script of a Ray node: `head` (ray start --head on its internal IP) or
# `worker` (joins HEAD_ADDRESS:RAY_PORT advertising its TPU chips). GCE runs it as root on every
# boot, so a re-created spot VM installs and joins with no operator; systemd restarts Ray when it
# stops (a head that was away: the worker keeps trying until it answers).
ray_startup_script() {
  local role=$1 install start extras
  if [[ $role == head ]]; then
    extras=elastic
    start=("$NODE_DIR/venv/bin/ray" start --block --head "--port=$RAY_PORT" --include-dashboard=false
      --disable-usage-stats)
  else
    extras=tpu,elastic
    start=("$NODE_DIR/venv/bin/ray" start --block "--address=$HEAD_ADDRESS:$RAY_PORT"
      "--resources={\"TPU\": $(chips_per_host)}" --disable-usage-stats)
  fi
  install=(bash "$NODE_DIR/dipaco_jax.new/launch/worker.sh" install
    "--remote-dir=$NODE_DIR/dipaco_jax" "--venv=$NODE_DIR/venv" "--log-file=$NODE_DIR/driver.log"
    "--python-version=$PYTHON_VERSION" "--uv-version=$UV_VERSION" "--extras=$extras")
  [[ -n $PIP_ARGS ]] && install+=("--pip-args=$PIP_ARGS")
  cat <<EOF
#!/bin/bash
# dipaco_jax Ray $role (launch/ray_actions.sh): install the code, then keep Ray running.
set -euo pipefail
export HOME=/root
mkdir -p $(shell_quote "$NODE_DIR")
$(fetch_code_lines)
$(shell_join "${install[@]}")
cat >$(shell_quote "$NODE_DIR/ray_start.sh") <<'START'
#!/bin/bash
EOF
  if [[ $role == head ]]; then
    # Bound to the internal IP (the metadata server's answer), never to an external one.
    cat <<'EOF'
ip=$(curl -sf -H 'Metadata-Flavor: Google' \
  http://metadata.google.internal/computeMetadata/v1/instance/network-interfaces/0/ip)
EOF
    echo "exec $(shell_join "${start[@]}") \"--node-ip-address=\$ip\""
  else
    echo "exec $(shell_join "${start[@]}")"
  fi
  cat <<EOF
START
cat >/etc/systemd/system/dipaco-ray.service <<'UNIT'
[Unit]
Description=dipaco_jax Ray $role
Wants=network-online.target
After=network-online.target

[Service]
ExecStart=/bin/bash $NODE_DIR/ray_start.sh
Restart=always
RestartSec=10

[Install]
WantedBy=multi-user.target
UNIT
# Not enabled: this script starts it once the code is installed, on every boot.
systemctl daemon-reload
systemctl restart dipaco-ray.service
EOF
}

# Writes the startup script of ROLE to TMPDIR/NAME-ray-ROLE.sh; sets STARTUP_FILE.
write_startup_script() {
  STARTUP_FILE="${TMPDIR:-/tmp}/$NAME-ray-$1.sh"
  ray_startup_script "$1" >"$STARTUP_FILE"
  note "startup script of the $1: $STARTUP_FILE"
}

# --- the head ----------------------------------------------------------------------------------

head_state() {
  local state
  state=$(gcloud_lookup gcloud compute instances describe "$HEAD_NAME" "--zone=$ZONE" \
    "--project=$PROJECT" '--format=value(status)')
  if ((DRY_RUN)) && [[ $DRY_RUN_ASSUME == ready ]]; then state=RUNNING; fi
  echo "$state"
}

create_head() {
  local extra=(--scopes=cloud-platform)
  [[ -n $SERVICE_ACCOUNT ]] && extra+=("--service-account=$SERVICE_ACCOUNT")
  ((INTERNAL_IP)) && extra+=(--no-address)
  if [[ -z $REPO_URL ]]; then
    pack_tree
    run gcloud storage cp "$TARBALL" "$CODE_URL" "--project=$PROJECT"
  fi
  write_startup_script head
  instances create "$HEAD_NAME" "--machine-type=$HEAD_MACHINE_TYPE" \
    "--image-family=$HEAD_IMAGE_FAMILY" "--image-project=$HEAD_IMAGE_PROJECT" \
    "--boot-disk-size=$HEAD_DISK_SIZE" "--network=$NETWORK" "--tags=$RAY_TAG" \
    "--metadata-from-file=startup-script=$STARTUP_FILE" "${extra[@]}"
}

# One look at the head and the step it calls for; sets HEAD_READY. The code is uploaded only when
# the head is created: every node of the cluster must run the same code (and Ray version).
ensure_head() {
  local state
  state=$(head_state)
  HEAD_READY=0
  ((DRY_RUN)) && note "dry run: assuming head $HEAD_NAME is ${state:-absent}"
  case $state in
    RUNNING)
      note "head $HEAD_NAME is RUNNING: using it"
      HEAD_READY=1
      ;;
    "")
      note "head $HEAD_NAME does not exist: creating it"
      create_head
      ;;
    TERMINATED | STOPPED)
      note "head $HEAD_NAME is $state: starting it (its startup script starts Ray)"
      instances start "$HEAD_NAME"
      ;;
    SUSPENDED)
      note "head $HEAD_NAME is SUSPENDED: resuming it"
      instances resume "$HEAD_NAME"
      ;;
    *) note "head $HEAD_NAME is $state: waiting" ;;
  esac
  if ((DRY_RUN && !HEAD_READY)); then
    note "dry run: assuming it becomes ready"
    HEAD_READY=1
  fi
}

require_head() {
  local state
  state=$(head_state)
  ((DRY_RUN)) && note "dry run: assuming head $HEAD_NAME is ${state:-absent}"
  [[ $state == RUNNING ]] ||
    die "head $HEAD_NAME is ${state:-absent}, not RUNNING: run ray_head.sh first"
}

# Sets HEAD_ADDRESS to the head's internal IP unless --head-address gave one.
resolve_head_address() {
  [[ -n $HEAD_ADDRESS ]] && return 0
  if ((DRY_RUN)); then
    gcloud_lookup gcloud compute instances describe "$HEAD_NAME" "--zone=$ZONE" \
      "--project=$PROJECT" '--format=value(networkInterfaces[0].networkIP)'
    HEAD_ADDRESS=HEAD_IP
    note "dry run: HEAD_IP stands for the internal IP the command above prints"
    return 0
  fi
  HEAD_ADDRESS=$(gcloud_lookup gcloud compute instances describe "$HEAD_NAME" "--zone=$ZONE" \
    "--project=$PROJECT" '--format=value(networkInterfaces[0].networkIP)')
  [[ -n $HEAD_ADDRESS ]] || die "no head address: the head VM $HEAD_NAME does not exist. Run" \
    "ray_head.sh first, or pass --head-address=HOST (the head's internal IP or DNS name)"
  note "the pool joins the head at $HEAD_ADDRESS:$RAY_PORT"
}

# --- the pool ----------------------------------------------------------------------------------

# One look at every TPU VM of the pool (create.sh's step for each, with the startup script); a
# preempted one is deleted and re-created when $1 is 1, and joins by itself once it boots.
ensure_pool() {
  local allow_recreate=$1 name=$NAME vm ready=0
  resolve_head_address
  write_startup_script worker
  CREATE_EXTRA=("--network=$NETWORK" "--tags=$RAY_TAG"
    "--metadata-from-file=startup-script=$STARTUP_FILE")
  for vm in $(pool_names); do
    NAME=$vm
    ensure_resource "$allow_recreate"
    ((RESOURCE_READY)) && ready=$((ready + 1))
  done
  NAME=$name
  note "pool: $ready of $POOL_SIZE TPU VMs ready ($(chips_per_host) chips per host)"
}

delete_pool() {
  local name=$NAME vm state
  for vm in $(pool_names); do
    NAME=$vm
    state=$(describe_state tpu-vm "$vm")
    ((DRY_RUN)) && note "dry run: assuming TPU VM $vm is $state"
    if [[ -n $state ]]; then
      note "TPU VM $vm is $state: deleting it"
      delete_resource
    else
      note "TPU VM $vm does not exist"
    fi
  done
  NAME=$name
}

# --- the driver --------------------------------------------------------------------------------

# The elastic driver on the head (as root, like Ray there): one worker actor per TPU chip of the
# pool; the trainer flags after `--` come after these, so they override them.
start_driver() {
  local start kv user=(${TRAINER_ARGS[@]+"${TRAINER_ARGS[@]}"})
  start=(sudo bash "$NODE_DIR/dipaco_jax/launch/worker.sh" start "--venv=$NODE_DIR/venv"
    "--log-file=$NODE_DIR/driver.log" --no-distributed)
  for kv in ${TRAIN_ENV_LIST[@]+"${TRAIN_ENV_LIST[@]}"}; do start+=("--env=$kv"); done
  ((RESTART)) && start+=(--restart)
  TRAINER_ARGS=(--config.dipaco.mode=elastic --config.elastic.address=auto
    "--config.elastic.num_workers=$(pool_chips)" '--config.elastic.worker_resources={"TPU": 1}'
    ${user[@]+"${user[@]}"})
  trainer_args
  TRAINER_ARGS=(${user[@]+"${user[@]}"})
  head_ssh "$(shell_join "${start[@]}" -- "${TRAINER_LINE[@]}")"
}

# Runs one shell command line on the head.
head_ssh() {
  local extra=()
  ((INTERNAL_IP)) && extra+=(--internal-ip)
  run gcloud compute ssh "$HEAD_NAME" "--zone=$ZONE" "--project=$PROJECT" "--command=$1" \
    ${extra[@]+"${extra[@]}"}
}
