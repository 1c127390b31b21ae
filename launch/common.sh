# shellcheck shell=bash
# Flags, validation and the command runner shared by every launch/*.sh script.
#
# Sourced, never run. One table (_FLAGS) drives parsing, defaults and --help, so a setting is
# declared once: flag `--x-y`, environment variable `DIPACO_X_Y`, default. Written for bash 3.2
# (macOS) too: no associative arrays, no mapfile, guarded empty-array expansions.

LAUNCH_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# Commands and notes go to fd 3 (the caller's stdout) so that functions whose stdout is captured
# with $(...) still show them. A dry run's output is therefore a runnable script.
exec 3>&1

# flag|VARIABLE|kind|default|help      (kind: str, bool or list; env var: DIPACO_<VARIABLE>)
_FLAGS=(
  "project|PROJECT|str||GCP project id (required; gcloud's default project is not used)"
  "zone|ZONE|str|us-central2-b|zone that offers the accelerator type"
  "name|NAME|str|dipaco-run|TPU VM or queued resource; multislice nodes are NAME-0 .. NAME-<N-1>"
  "accelerator-type|ACCELERATOR_TYPE|str|v4-8|TPU type of one slice (see the list below)"
  "runtime-version|RUNTIME_VERSION|str||TPU software version (default: the generation's, below)"
  "node-count|NODE_COUNT|str|1|slices; N > 1 makes a multislice queued resource"
  "queued|QUEUED|bool|0|use a queued resource even for a single slice"
  "spot|SPOT|bool|0|Spot TPUs (cheaper, preemptible at any time)"
  "reserved|RESERVED|bool|0|queued resource from the project's reservation (queued resources only)"
  "guaranteed|GUARANTEED|bool|0|queued resource that is never preempted (queued resources only)"
  "valid-until-duration|VALID_UNTIL_DURATION|str||queued resource request expires if not filled within this long, e.g. 6h or 2d"
  "valid-until-time|VALID_UNTIL_TIME|str||queued resource request expires if not filled by this time (RFC 3339, e.g. 2026-12-01T09:00:00Z)"
  "preemptible|PREEMPTIBLE|bool|0|legacy preemptible TPU VM (TPU VMs only; prefer --spot)"
  "service-account|SERVICE_ACCOUNT|str||create.sh: the TPU VMs' service account (default: the project's Compute Engine default); project.sh: the account to grant the bucket to"
  "internal-ip|INTERNAL_IP|bool|0|TPU VMs without external IPs (create --internal-ips); ssh/scp reach them by internal IP, so run the scripts inside the VPC"
  "recreate|RECREATE|bool|0|create.sh: delete and re-create a failed or preempted resource"
  "wait|WAIT|bool|0|create.sh: poll until the resource is ready"
  "poll-seconds|POLL_SECONDS|str|60|seconds between state polls (create.sh --wait, watch.sh)"
  "max-polls|MAX_POLLS|str|0|stop polling after this many polls (0: never)"
  "max-failures|MAX_FAILURES|str|5|watch.sh: give up after this many failed polls in a row"
  "stall-minutes|STALL_MINUTES|str|30|watch.sh: restart the trainer when the metrics got no record for this long (0: never)"
  "metrics-file|METRICS_FILE|str|metrics*.jsonl|watch.sh: the run's metrics under --workdir (a wildcard: the newest write counts)"
  "dry-run|DRY_RUN|bool|0|print the exact commands and run none of them"
  "repo-url|REPO_URL|str||setup.sh: git clone this URL on the workers instead of copying"
  "branch|BRANCH|str|main|setup.sh: branch or tag to clone with --repo-url"
  "local-repo|LOCAL_REPO|str||setup.sh: local tree to copy (default: this checkout)"
  "remote-dir|REMOTE_DIR|str|dipaco_jax|code on each worker (relative: under its home)"
  "venv|VENV|str|dipaco_venv|virtualenv on each worker (relative: under its home)"
  "pip-args|PIP_ARGS|str||extra arguments for the install on the workers (uv pip install)"
  "python-version|PYTHON_VERSION|str|3.11|Python of the workers' venv, fetched by uv (constraints.txt is tested on it)"
  "uv-version|UV_VERSION|str|0.13.9|uv release the workers fetch to make the venv and install"
  "config|CONFIG|str|configs/tiny.py|trainer config file, relative to the repo"
  "workdir|WORKDIR|str||gs:// run directory: checkpoints, metrics (train.sh, watch.sh)"
  "bucket|BUCKET|str||project.sh: the gs:// bucket to make (default: --workdir's bucket)"
  "location|LOCATION|str||project.sh: the bucket's location (default: --zone's region)"
  "data-dir|DATA_DIR|str||passed as --config.data.tfds_data_dir (e.g. gs://bucket/tfds)"
  "vocab-path|VOCAB_PATH|str||passed as --config.data.vocab_path (e.g. gs://bucket/spm.model)"
  "env|TRAIN_ENV|list||KEY=VALUE added to the trainer's environment (repeatable)"
  "log-file|LOG_FILE|str|dipaco_train.log|trainer log on each worker (relative: under its home)"
  "restart|RESTART|bool|0|train.sh: stop a trainer that is still running, then start"
  "node|NODE|str|0|logs.sh: slice index, or all"
  "worker|WORKER|str|0|logs.sh: worker index within a slice, or all"
  "lines|TAIL_LINES|str|100|logs.sh: lines of log to show"
  "follow|FOLLOW|bool|1|logs.sh: keep following the log (--no-follow prints and exits)"
  "extras|EXTRAS|str|tpu|worker.sh install: the package extras (pip install -e 'DIR[EXTRAS]')"
  "distributed|DISTRIBUTED|bool|1|worker.sh start: set DIPACO_DISTRIBUTED=1 (jax.distributed on TPU VMs; ray_train.sh turns it off)"
  "pool-size|POOL_SIZE|str|2|ray_*.sh: spot TPU VMs in the Ray pool, named NAME-0 .. NAME-<N-1>"
  "head-name|HEAD_NAME|str||ray_*.sh: the Ray head, a CPU VM (default: NAME-head)"
  "head-machine-type|HEAD_MACHINE_TYPE|str|e2-standard-8|ray_head.sh: machine type of the head"
  "head-image-family|HEAD_IMAGE_FAMILY|str|debian-12|ray_head.sh: image family of the head"
  "head-image-project|HEAD_IMAGE_PROJECT|str|debian-cloud|ray_head.sh: project of that image family"
  "head-disk-size|HEAD_DISK_SIZE|str|50GB|ray_head.sh: boot disk of the head (venv, logs)"
  "head-address|HEAD_ADDRESS|str||ray_workers.sh, ray_watch.sh: host (IP or DNS name) the pool joins (default: the head VM's internal IP)"
  "ray-port|RAY_PORT|str|6379|ray_*.sh: the head's Ray port (GCS)"
  "network|NETWORK|str|default|ray_*.sh: VPC network of the head, the pool and the firewall rule"
  "node-dir|NODE_DIR|str|/opt/dipaco|ray_*.sh, gke.sh: code and venv on each Ray node or GKE pod (absolute)"
  "code-url|CODE_URL|str||ray_*.sh, gke.sh: gs:// object of the code the Ray nodes or GKE pods install when they start (default: WORKDIR/code/dipaco_jax.tar.gz)"
  "cluster|CLUSTER|str||gke.sh: the GKE cluster (in --zone) with a TPU node pool per slice and JobSet installed"
  "image|IMAGE|str|gcr.io/google.com/cloudsdktool/google-cloud-cli:slim|gke.sh: the pods' container image (needs bash, curl and gcloud)"
)

# Known slice sizes (the number after the dash) and default software version per generation.
_GENERATIONS="v4 v5litepod v5p v6e"
_sizes() {
  case $1 in
    v4) echo "8 16 32 64 128 256 512 1024 1536 2048 4096" ;;
    v5litepod) echo "1 4 8 16 32 64 128 256" ;;
    v5p) echo "8 16 32 64 128 256 512 1024 2048 4096 6144 8192 12288" ;;
    v6e) echo "1 4 8 16 32 64 128 256" ;;
  esac
}
_default_runtime() {
  case $1 in
    v4) echo tpu-ubuntu2204-base ;;
    v5litepod) echo v2-alpha-tpuv5-lite ;;
    v5p) echo v2-alpha-tpuv5 ;;
    v6e) echo v2-alpha-tpuv6e ;;
  esac
}

note() { printf '# %s\n' "$*" >&3; }
die() { printf 'error: %s\n' "$*" >&2; exit 2; }

usage() {
  local entry flag var kind default help gen
  sed -n '2,/^$/s/^# \{0,1\}//p' "$0"
  echo "Flags (each also read from the environment variable DIPACO_<NAME>):"
  for entry in "${_FLAGS[@]}"; do
    IFS='|' read -r flag var kind default help <<< "$entry"
    if [[ $kind == bool ]]; then
      flag="[no-]$flag"
      [[ $default == 1 ]] && default=on || default=""
    else
      flag="$flag=..."
    fi
    printf '  --%-24s %s%s\n' "$flag" "$help" "${default:+ [$default]}"
  done
  echo "Flags go before '--'; arguments after '--' go to the trainer unchanged."
  echo "Accelerator types and their default runtime versions:"
  for gen in $_GENERATIONS; do
    printf '  %-10s sizes %s; runtime %s\n' "$gen" "$(_sizes "$gen")" "$(_default_runtime "$gen")"
  done
}

# Sets every variable from its environment variable or default, then from the command line.
# Arguments after '--' land in TRAINER_ARGS; TRAIN_ENV (a list) lands in TRAIN_ENV_LIST.
parse_flags() {
  local entry flag var kind default help arg name value found env_name
  for entry in "${_FLAGS[@]}"; do
    IFS='|' read -r flag var kind default help <<< "$entry"
    env_name="DIPACO_$var"
    printf -v "$var" '%s' "${!env_name-$default}"
  done
  TRAIN_ENV_LIST=()
  [[ -n $TRAIN_ENV ]] && read -r -a TRAIN_ENV_LIST <<< "$TRAIN_ENV"
  TRAINER_ARGS=()
  while (($#)); do
    arg=$1
    shift
    case $arg in
      -h | --help) usage; exit 0 ;;
      --) TRAINER_ARGS=("$@"); break ;;
      --*) ;;
      *) die "unexpected argument '$arg': flags look like --name=value; trainer flags go after '--'" ;;
    esac
    name=${arg#--}
    name=${name%%=*}
    found=""
    for entry in "${_FLAGS[@]}"; do
      IFS='|' read -r flag var kind default help <<< "$entry"
      if [[ $name == "$flag" || ($kind == bool && $name == "no-$flag") ]]; then
        found=1
        break
      fi
    done
    [[ -n $found ]] || die "unknown flag --$name (see $(basename "$0") --help)"
    if [[ $kind == bool ]]; then
      [[ $arg != *=* ]] || die "--$name takes no value: use --$flag or --no-$flag"
      [[ $name == no-* ]] && value=0 || value=1
    elif [[ $arg == *=* ]]; then
      value=${arg#*=}
    else
      (($#)) || die "--$name needs a value"
      value=$1
      shift
    fi
    if [[ $kind == list ]]; then
      TRAIN_ENV_LIST+=("$value")
    else
      printf -v "$var" '%s' "$value"
    fi
  done
  LOCAL_REPO=${LOCAL_REPO:-$(dirname "$LAUNCH_DIR")}
  for entry in "${_FLAGS[@]}"; do
    IFS='|' read -r flag var kind default help <<< "$entry"
    [[ $kind != bool || ${!var} == [01] ]] || die "DIPACO_$var must be 0 or 1, got '${!var}'"
  done
}

_is_count() { [[ $1 =~ ^[0-9]+$ ]]; }

# Checks the project, zone and service account; dies before any call.
validate_project() {
  [[ -n $PROJECT ]] || die "no project: pass --project=PROJECT_ID or set DIPACO_PROJECT"
  [[ $PROJECT =~ ^([a-z0-9.-]+:)?[a-z][a-z0-9-]{4,28}[a-z0-9]$ ]] ||
    die "--project=$PROJECT is not a GCP project id (6-30 lowercase letters, digits, hyphens)"
  [[ $ZONE =~ ^[a-z]+-[a-z]+[0-9]+-[a-z]$ ]] ||
    die "--zone=$ZONE is not a zone name like us-central2-b"
  [[ -z $SERVICE_ACCOUNT || $SERVICE_ACCOUNT =~ ^[A-Za-z0-9._-]+@[A-Za-z0-9.-]+\.gserviceaccount\.com$ ]] ||
    die "--service-account=$SERVICE_ACCOUNT is not a service account email (NAME@PROJECT.iam.gserviceaccount.com)"
}

# Checks everything a gcloud call about the TPU resource needs; dies before any call.
validate_resource() {
  local gen size
  validate_project
  [[ $NAME =~ ^[a-z]([-a-z0-9]{0,48}[a-z0-9])?$ ]] ||
    die "--name=$NAME: use lowercase letters, digits and hyphens, starting with a letter"
  gen=${ACCELERATOR_TYPE%-*}
  size=${ACCELERATOR_TYPE##*-}
  if [[ $ACCELERATOR_TYPE != *-* || -z $(_sizes "$gen") || " $(_sizes "$gen") " != *" $size "* ]]; then
    local valid="" g
    for g in $_GENERATIONS; do valid+="$(printf '\n  %s-{%s}' "$g" "$(_sizes "$g" | tr ' ' ',')")"; done
    die "unknown accelerator type '$ACCELERATOR_TYPE'. Valid types:$valid"
  fi
  RUNTIME_VERSION=${RUNTIME_VERSION:-$(_default_runtime "$gen")}
  { _is_count "$NODE_COUNT" && ((10#$NODE_COUNT >= 1)); } ||
    die "--node-count=$NODE_COUNT: need a whole number >= 1 (1: one slice; N > 1: N slices)"
  NODE_COUNT=$((10#$NODE_COUNT))
  ((SPOT + PREEMPTIBLE < 2)) || die "--spot and --preemptible exclude each other; pick --spot"
  if ((PREEMPTIBLE)) && uses_queued_resource; then
    die "--preemptible is for single TPU VMs; queued resources (--node-count > 1, --queued) take --spot"
  fi
  validate_queueing
  _is_count "$POLL_SECONDS" || die "--poll-seconds=$POLL_SECONDS: need a whole number of seconds"
  _is_count "$MAX_POLLS" || die "--max-polls=$MAX_POLLS: need a whole number (0: poll forever)"
  _is_count "$MAX_FAILURES" || die "--max-failures=$MAX_FAILURES: need a whole number"
  _is_count "$STALL_MINUTES" || die "--stall-minutes=$STALL_MINUTES: need a whole number (0: never)"
  [[ $PYTHON_VERSION =~ ^3\.[0-9]+$ ]] || die "--python-version=$PYTHON_VERSION: need 3.N, e.g. 3.11"
  [[ $UV_VERSION =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "--uv-version=$UV_VERSION: need a release like 0.13.9"
}

# Checks what starting the trainer needs.
validate_train() {
  [[ -n $WORKDIR ]] || die "no workdir: pass --workdir=gs://BUCKET/RUN or set DIPACO_WORKDIR"
  [[ $WORKDIR == gs://?* ]] ||
    die "--workdir=$WORKDIR must be a gs:// path: every worker must see the same checkpoints, and a preempted VM's disk is gone"
  if [[ -z $REPO_URL && ! -f $LOCAL_REPO/${CONFIG%%:*} ]]; then
    die "--config=$CONFIG: no such file in $LOCAL_REPO (configs are relative to the repo root)"
  fi
  local kv
  for kv in ${TRAIN_ENV_LIST[@]+"${TRAIN_ENV_LIST[@]}"}; do
    [[ $kv =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env=$kv: need KEY=VALUE"
  done
}

uses_queued_resource() { ((NODE_COUNT > 1 || QUEUED)); }

# The queued resource's capacity (--spot, --reserved, --guaranteed: one at most) and how long its
# request waits (--valid-until-duration or --valid-until-time); each queued-only flag is refused
# for a single TPU VM, which `tpu-vm create` makes at once or not at all.
validate_queueing() {
  local queued_only=""
  ((SPOT + RESERVED + GUARANTEED < 2)) ||
    die "--spot, --reserved and --guaranteed each name the capacity to use: pick one"
  ((RESERVED)) && queued_only=--reserved
  ((GUARANTEED)) && queued_only=--guaranteed
  [[ -n $VALID_UNTIL_DURATION ]] && queued_only=--valid-until-duration
  [[ -n $VALID_UNTIL_TIME ]] && queued_only=--valid-until-time
  if [[ -n $queued_only ]] && ! uses_queued_resource; then
    die "$queued_only is a queued resource's: add --queued (or --node-count > 1)"
  fi
  [[ -z $VALID_UNTIL_DURATION || -z $VALID_UNTIL_TIME ]] ||
    die "--valid-until-duration and --valid-until-time both set the expiry: pick one"
  [[ -z $VALID_UNTIL_DURATION || $VALID_UNTIL_DURATION =~ ^([0-9]+[dhms])+$ ]] ||
    die "--valid-until-duration=$VALID_UNTIL_DURATION: need a duration like 6h, 2d or 1h30m"
  [[ -z $VALID_UNTIL_TIME || $VALID_UNTIL_TIME =~ ^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}(:[0-9]{2}(\.[0-9]+)?)?(Z|[+-][0-9]{2}:[0-9]{2})$ ]] ||
    die "--valid-until-time=$VALID_UNTIL_TIME: need an RFC 3339 time like 2026-12-01T09:00:00Z"
}

# The TPU VM node names: NAME, or NAME-0 .. NAME-<N-1> for a multislice queued resource.
node_names() {
  local i
  if ((NODE_COUNT > 1)); then
    for ((i = 0; i < NODE_COUNT; i++)); do echo "$NAME-$i"; done
  else
    echo "$NAME"
  fi
}

# One word quoted for a POSIX shell, only where needed; `--flag=value` keeps the flag bare.
shell_quote() {
  local word=$1 quote="'\\''"
  if [[ $word =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
    printf '%s' "$word"
  elif [[ $word =~ ^(--[A-Za-z0-9.-]+=)(.+)$ ]]; then
    local flag=${BASH_REMATCH[1]} value=${BASH_REMATCH[2]}
    printf '%s' "$flag"
    shell_quote "$value"
  else
    printf "'%s'" "${word//\'/$quote}"
  fi
}

# The words joined into one shell command line.
shell_join() {
  local out="" word
  for word in "$@"; do out+="${out:+ }$(shell_quote "$word")"; done
  printf '%s' "$out"
}

# Prints a command exactly; runs it unless this is a dry run.
run() {
  if ((DRY_RUN)); then
    printf '%s\n' "$(shell_join "$@")" >&3
    return 0
  fi
  printf '+ %s\n' "$(shell_join "$@")" >&3
  "$@"
}
