# shellcheck shell=bash
# The gcloud steps as functions: read a resource's state, create, delete, set up, start, tail.
#
# Sourced after common.sh and parse_flags. Every gcloud call goes through `run`, so a dry run
# prints it instead. A single slice is a TPU VM (or, with --queued, a queued resource with one
# node named NAME); N > 1 slices are one queued resource whose nodes are NAME-0 .. NAME-<N-1>.

# What a dry run pretends `describe` answered: absent (create.sh, watch.sh) or ready (the rest).
DRY_RUN_ASSUME=${DRY_RUN_ASSUME:-ready}

resource_group() { if uses_queued_resource; then echo queued-resources; else echo tpu-vm; fi; }
resource_label() { if uses_queued_resource; then echo "queued resource"; else echo "TPU VM"; fi; }

# gcloud compute tpus GROUP VERB POSITIONALS... --zone --project FLAGS... (ssh and scp reach the
# workers by internal IP with --internal-ip).
tpus() {
  local words=(gcloud compute tpus "$1" "$2") verb=$2 extra=()
  shift 2
  while (($#)) && [[ $1 != --* ]]; do
    words+=("$1")
    shift
  done
  [[ $verb == ssh || $verb == scp ]] && ((INTERNAL_IP)) && extra+=(--internal-ip)
  run "${words[@]}" "--zone=$ZONE" "--project=$PROJECT" "$@" ${extra[@]+"${extra[@]}"}
}

# Prints the state of one resource, nothing when it does not exist; dies on other gcloud errors.
describe_state() {
  local group=$1 name=$2 format=state err out
  [[ $group == queued-resources ]] && format=state.state
  if ((DRY_RUN)); then
    tpus "$group" describe "$name" "--format=value($format)"
    if [[ $DRY_RUN_ASSUME == ready && $group == queued-resources ]]; then echo ACTIVE; fi
    if [[ $DRY_RUN_ASSUME == ready && $group == tpu-vm ]]; then echo READY; fi
    return 0
  fi
  err=$(mktemp)
  if out=$(tpus "$group" describe "$name" "--format=value($format)" 2>"$err"); then
    rm -f "$err"
    printf '%s\n' "$out"
    return 0
  fi
  if grep -qi 'not.found' "$err"; then
    rm -f "$err"
    return 0
  fi
  cat "$err" >&2
  rm -f "$err"
  die "gcloud could not describe $group $name (see above)"
}

# The state of the whole resource: the queued resource's (or VM's) own state, and for an ACTIVE
# queued resource the first node that is not READY (NODE_MISSING when a node is gone).
resource_state() {
  local state node node_state
  state=$(describe_state "$(resource_group)" "$NAME")
  if [[ $state == ACTIVE ]] && uses_queued_resource; then
    for node in $(node_names); do
      node_state=$(describe_state tpu-vm "$node")
      if [[ $node_state != READY ]]; then
        echo "${node_state:-NODE_MISSING}"
        return 0
      fi
    done
  fi
  echo "$state"
}

# ready | absent | pending (will become ready) | leaving (on its way out) | broken | unknown.
state_class() {
  case $1 in
    READY | ACTIVE) echo ready ;;
    "") echo absent ;;
    CREATING | ACCEPTED | PROVISIONING | WAITING_FOR_RESOURCES | STARTING | RESTARTING | REPAIRING)
      echo pending ;;
    DELETING | SUSPENDING | STOPPING) echo leaving ;;
    FAILED | SUSPENDED | PREEMPTED | TERMINATED | STOPPED | NODE_MISSING) echo broken ;;
    *) echo unknown ;;
  esac
}

# CREATE_EXTRA: more flags for `tpu-vm create` (the Ray pool's startup script and tag).
CREATE_EXTRA=()

create_resource() {
  local extra=()
  [[ -n $SERVICE_ACCOUNT ]] && extra+=("--service-account=$SERVICE_ACCOUNT")
  ((INTERNAL_IP)) && extra+=(--internal-ips)
  ((SPOT)) && extra+=(--spot)
  ((PREEMPTIBLE)) && extra+=(--preemptible)
  ((RESERVED)) && extra+=(--reserved)
  ((GUARANTEED)) && extra+=(--guaranteed)
  [[ -n $VALID_UNTIL_DURATION ]] && extra+=("--valid-until-duration=$VALID_UNTIL_DURATION")
  [[ -n $VALID_UNTIL_TIME ]] && extra+=("--valid-until-time=$VALID_UNTIL_TIME")
  if uses_queued_resource; then
    if ((NODE_COUNT > 1)); then
      # The prefix is the default anyway; naming it keeps the node names certain.
      extra=("--node-count=$NODE_COUNT" "--node-prefix=$NAME" ${extra[@]+"${extra[@]}"})
    else
      extra=("--node-id=$NAME" ${extra[@]+"${extra[@]}"})
    fi
    tpus queued-resources create "$NAME" "--accelerator-type=$ACCELERATOR_TYPE" \
      "--runtime-version=$RUNTIME_VERSION" "${extra[@]}"
  else
    tpus tpu-vm create "$NAME" "--accelerator-type=$ACCELERATOR_TYPE" \
      "--version=$RUNTIME_VERSION" ${extra[@]+"${extra[@]}"} ${CREATE_EXTRA[@]+"${CREATE_EXTRA[@]}"}
  fi
}

delete_resource() {
  if uses_queued_resource; then
    tpus queued-resources delete "$NAME" --force --quiet  # --force: its nodes go first
  else
    tpus tpu-vm delete "$NAME" --quiet
  fi
}

# One look at the resource and the one step it calls for. Sets RESOURCE_STATE and RESOURCE_READY.
# A broken resource is re-created only when $1 is 1 (watch.sh, create.sh --recreate).
ensure_resource() {
  local allow_recreate=$1 label state
  label="$(resource_label) $NAME"
  state=$(resource_state)
  RESOURCE_STATE=$state
  RESOURCE_READY=0
  ((DRY_RUN)) && note "dry run: assuming $label is ${state:-absent}"
  case $(state_class "$state") in
    ready)
      note "$label is $state: using it"
      RESOURCE_READY=1
      ;;
    absent)
      note "$label does not exist: creating it"
      create_resource
      ;;
    pending) note "$label is $state: waiting for it to become ready" ;;
    leaving) note "$label is $state: waiting for it to go" ;;
    broken)
      ((allow_recreate)) || die "$label is $state (preempted or failed). Re-create it with" \
        "create.sh --recreate, or let watch.sh do it; the run resumes from its workdir"
      note "$label is $state: deleting and re-creating it"
      delete_resource
      create_resource
      ;;
    *)
      ((allow_recreate)) || die "$label is in an unexpected state '$state'; look with gcloud"
      note "$label is in an unexpected state '$state': waiting"
      ;;
  esac
  if ((DRY_RUN && !RESOURCE_READY)); then
    note "dry run: assuming it becomes ready"
    RESOURCE_READY=1
  fi
}

# Dies unless the resource (and every node) is ready: the worker steps need running VMs.
require_ready() {
  local state
  state=$(resource_state)
  ((DRY_RUN)) && note "dry run: assuming $(resource_label) $NAME is ${state:-absent}"
  [[ $(state_class "$state") == ready ]] ||
    die "$(resource_label) $NAME is ${state:-absent}, not ready: run create.sh (--wait) first"
}

# Runs one shell command line on every worker of every slice.
on_all_workers() {
  local node
  for node in $(node_names); do
    tpus tpu-vm ssh "$node" --worker=all "--command=$1"
  done
}

# Packs the local tree as git sees it (tracked and untracked files, ignored ones left out: no
# .venv, no workdirs) into TARBALL.
pack_tree() {
  local list file
  TARBALL="${TMPDIR:-/tmp}/$NAME-code.tar.gz"
  list="$TARBALL.files"
  git -C "$LOCAL_REPO" rev-parse --git-dir >/dev/null 2>&1 ||
    die "--local-repo=$LOCAL_REPO is not a git checkout (git decides what to leave out); or use --repo-url"
  git -C "$LOCAL_REPO" ls-files -z --cached --others --exclude-standard |
    while IFS= read -r -d '' file; do
      if [[ -e $LOCAL_REPO/$file ]]; then printf '%s\n' "$file"; fi
    done >"$list"
  note "$(wc -l <"$list" | tr -d ' ') files listed by git in $list"
  run tar -czf "$TARBALL" -C "$LOCAL_REPO" -T "$list"
}

# Puts the code on every worker (copy of the local tree, or a git clone) and installs it. The new
# tree lands in REMOTE_DIR.new; worker.sh swaps it in unless a trainer is still running there.
# Slices are set up in parallel, each logging to its own file (see each_slice_in_parallel).
setup_workers() {
  local new="$REMOTE_DIR.new" fetch install
  install=(bash "$new/launch/worker.sh" install "--remote-dir=$REMOTE_DIR" "--venv=$VENV"
    "--log-file=$LOG_FILE" "--python-version=$PYTHON_VERSION" "--uv-version=$UV_VERSION")
  [[ -n $PIP_ARGS ]] && install+=("--pip-args=$PIP_ARGS")
  ((RESTART)) && install+=(--restart)
  if [[ -n $REPO_URL ]]; then
    fetch="rm -rf $(shell_quote "$new") && $(shell_join git clone --depth=1 "--branch=$BRANCH" \
      "$REPO_URL" "$new")"
  else
    pack_tree
    fetch="rm -rf $(shell_quote "$new") && mkdir -p $(shell_quote "$new") && $(shell_join tar \
      -xzf "$REMOTE_DIR.tar.gz" -C "$new")"
  fi
  each_slice_in_parallel setup setup_slice "$fetch && $(shell_join "${install[@]}")"
}

# One slice's setup: copy the packed tree to its workers (unless they clone), then install.
setup_slice() {
  local node=$1 command=$2
  [[ -n $REPO_URL ]] || tpus tpu-vm scp "$TARBALL" "$node:$REMOTE_DIR.tar.gz" --worker=all
  tpus tpu-vm ssh "$node" --worker=all "--command=$command"
}

# Runs `FUNCTION NODE ARGS...` for every slice. One slice, or a dry run: in turn, output as it
# comes. Several: as background jobs, each writing to TMPDIR/NAME-STEP/NODE.log; once all have
# ended the logs are shown in slice order, then which slices failed. Fails if any failed.
each_slice_in_parallel() {
  local step=$1 fn=$2 dir node i rc failed=() pids=() nodes=()
  shift 2
  read -r -a nodes <<<"$(node_names | tr '\n' ' ')"
  if ((DRY_RUN || ${#nodes[@]} == 1)); then
    for node in "${nodes[@]}"; do "$fn" "$node" "$@"; done
    return 0
  fi
  dir="${TMPDIR:-/tmp}/$NAME-$step"
  mkdir -p "$dir"
  note "$step on ${#nodes[@]} slices in parallel; logs: $dir/<slice>.log"
  for node in "${nodes[@]}"; do
    (set -e; "$fn" "$node" "$@") >"$dir/$node.log" 2>&1 3>&1 &
    pids+=("$!")
  done
  trap 'kill "${pids[@]}" 2>/dev/null; exit 130' INT TERM
  for ((i = 0; i < ${#nodes[@]}; i++)); do
    node=${nodes[i]}
    rc=0
    wait "${pids[i]}" || rc=$?
    note "--- $step of $node (exit $rc; log $dir/$node.log) ---"
    cat "$dir/$node.log" >&3
    ((rc == 0)) || failed+=("$node (exit $rc)")
  done
  trap - INT TERM
  ((${#failed[@]} == 0)) || die "$step failed on ${#failed[@]} of ${#nodes[@]} slices:" \
    "${failed[*]}; see the logs in $dir"
}

# The trainer command line, as given to worker.sh start.
trainer_args() {
  TRAINER_LINE=("--config=$CONFIG" "--workdir=$WORKDIR")
  [[ -n $DATA_DIR ]] && TRAINER_LINE+=("--config.data.tfds_data_dir=$DATA_DIR")
  [[ -n $VOCAB_PATH ]] && TRAINER_LINE+=("--config.data.vocab_path=$VOCAB_PATH")
  TRAINER_LINE+=(${TRAINER_ARGS[@]+"${TRAINER_ARGS[@]}"})
}

# Starts the same trainer command on every worker of every slice, in the background.
train_workers() {
  local start kv
  start=(bash "$REMOTE_DIR/launch/worker.sh" start "--venv=$VENV" "--log-file=$LOG_FILE")
  for kv in ${TRAIN_ENV_LIST[@]+"${TRAIN_ENV_LIST[@]}"}; do start+=("--env=$kv"); done
  ((RESTART)) && start+=(--restart)
  trainer_args
  on_all_workers "$(shell_join "${start[@]}" -- "${TRAINER_LINE[@]}")"
}

# Shows (and by default follows) the trainer log of the chosen worker(s) and slice(s).
tail_logs() {
  local nodes node tail_cmd
  [[ $WORKER == all ]] || _is_count "$WORKER" || die "--worker=$WORKER: need an index or all"
  _is_count "$TAIL_LINES" || die "--lines=$TAIL_LINES: need a whole number"
  if [[ $NODE == all ]]; then
    nodes=$(node_names)
    ((!FOLLOW || NODE_COUNT == 1)) ||
      die "--node=all with --follow would follow only the first slice: add --no-follow, or pick --node"
  else
    { _is_count "$NODE" && ((10#$NODE < NODE_COUNT)); } ||
      die "--node=$NODE: need all or an index below --node-count=$NODE_COUNT"
    nodes=$(node_names | sed -n "$((10#$NODE + 1))p")
  fi
  tail_cmd=(tail -n "$TAIL_LINES")
  ((FOLLOW)) && tail_cmd+=(-F)
  tail_cmd+=("$LOG_FILE")
  for node in $nodes; do
    tpus tpu-vm ssh "$node" "--worker=$WORKER" "--command=$(shell_join "${tail_cmd[@]}")"
  done
}

# --- watch.sh's stall check --------------------------------------------------------------------

# Seconds since 1970 now (a function, so that tests can move the clock).
now_seconds() { date -u +%s; }

# An ISO time such as 2024-05-01T12:00:00Z in seconds since 1970 (GNU or BSD date).
iso_seconds() {
  date -u -d "$1" +%s 2>/dev/null || date -u -j -f '%Y-%m-%dT%H:%M:%SZ' "$1" +%s
}

# The newest write time of the run's metrics files (WORKDIR/METRICS_FILE) in seconds since 1970;
# nothing when there is none yet. `gcloud storage ls -l` rows read SIZE TIME URL.
metrics_seconds() {
  local url="${WORKDIR%/}/$METRICS_FILE" err out newest
  err=$(mktemp)
  if ! out=$(run gcloud storage ls -l "$url" "--project=$PROJECT" 2>"$err"); then
    if grep -qi 'matched no objects\|not.found' "$err"; then
      rm -f "$err"
      return 0
    fi
    cat "$err" >&2
    rm -f "$err"
    die "gcloud could not list $url (see above)"
  fi
  rm -f "$err"
  newest=$(printf '%s\n' "$out" | awk '$3 ~ /^gs:/ && $2 ~ /^[0-9]+-/ {print $2}' | sort | tail -n 1)
  if [[ -n $newest ]]; then iso_seconds "$newest"; fi
}

# Restarts the trainer on every worker when neither a metrics record nor the watcher's last start
# (STARTED_AT, seconds since 1970) is newer than STALL_MINUTES: a trainer that died or hangs on a
# healthy slice. Sets STALL_RESTARTED to 1 after a restart. Call it as a plain command, not as a
# condition, so that a failed listing or ssh fails the poll (set -e) instead of passing for news.
# $1, $2: the function that restarts and what it restarts (ray_watch.sh: the driver on the head).
restart_if_stalled() {
  local restart=${1:-train_workers} what=${2:-the trainer on every worker} last now newest
  STALL_RESTARTED=0
  ((STALL_MINUTES > 0)) || return 0
  newest=$(metrics_seconds)
  last=$STARTED_AT
  if [[ -n $newest ]] && ((newest > last)); then last=$newest; fi
  now=$(now_seconds)
  ((now - last >= STALL_MINUTES * 60)) || return 0
  note "no new metrics record in ${WORKDIR%/}/$METRICS_FILE for $(((now - last) / 60)) minutes" \
    "(--stall-minutes=$STALL_MINUTES): restarting $what"
  RESTART=1
  "$restart"
  STALL_RESTARTED=1
}

# The watchers' loop (watch.sh, ray_watch.sh): poll_once every --poll-seconds until --max-polls,
# or until --max-failures polls in a row fail. poll_once's exit status: 0 ready (the run started
# if needed); 3 not ready: start again once ready, with RESTART=1 (what survived the outage is
# out of step: the workers' trainers, or the driver of a head that was away); 4 the trainer was
# restarted for want of new metrics. After 0 or 3 the watcher's poll_reached hook runs, if any.
watch_polls() {
  local poll rc failures=0
  START_NEEDED=1 # the first ready look starts the run (a trainer that already runs is left alone)
  STARTED_AT=0   # when this watcher last started the trainer: the stall check counts from there
  for ((poll = 1; ; poll++)); do
    set +e
    poll_once
    rc=$?
    set -e
    case $rc in
      0)
        if ((START_NEEDED)); then STARTED_AT=$(now_seconds); fi
        START_NEEDED=0 failures=0
        ;;
      4) STARTED_AT=$(now_seconds) failures=0 ;;
      3) START_NEEDED=1 failures=0 RESTART=1 ;;
      *)
        failures=$((failures + 1))
        note "poll $poll failed (exit $rc); $failures in a row"
        ((failures < MAX_FAILURES)) || die "$failures polls in a row failed; see the errors above"
        ;;
    esac
    if ((rc == 0 || rc == 3)) && declare -F poll_reached >/dev/null; then poll_reached; fi
    if ((DRY_RUN || (MAX_POLLS && poll >= MAX_POLLS))); then break; fi
    sleep "$POLL_SECONDS"
  done
}

# The TPU chips of one host of ACCELERATOR_TYPE: Ray's TPU resource, GKE's google.com/tpu (v4
# and v5p sizes count cores, two per chip; single-host v5e/v6e slices have 1, 4 or 8 chips,
# larger ones 4 per host).
chips_per_host() {
  local gen=${ACCELERATOR_TYPE%-*} size=${ACCELERATOR_TYPE##*-} chips max=8
  case $gen in
    v4 | v5p) chips=$((size / 2)) max=4 ;;
    *) chips=$size ;;
  esac
  if ((chips > max)); then chips=4; fi
  echo "$chips"
}

# The lines that put the code in NODE_DIR/dipaco_jax.new (a git clone, or the tarball at CODE_URL).
fetch_code_lines() {
  local new="$NODE_DIR/dipaco_jax.new"
  echo "rm -rf $(shell_quote "$new")"
  if [[ -n $REPO_URL ]]; then
    shell_join git clone --depth=1 "--branch=$BRANCH" "$REPO_URL" "$new"
    echo
  else
    shell_join gcloud storage cp "$CODE_URL" "$NODE_DIR/code.tar.gz"
    echo
    echo "mkdir -p $(shell_quote "$new")"
    shell_join tar -xzf "$NODE_DIR/code.tar.gz" -C "$new"
    echo
  fi
}
