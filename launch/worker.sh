#!/usr/bin/env bash
# Worker side: runs on each TPU VM worker, sent there by setup.sh and train.sh over ssh.
#
#   worker.sh install [--remote-dir=D --venv=V --python-version=P --uv-version=U --pip-args=A
#                      --extras=E --restart]
#       run from a fresh tree D.new: swap it in as D (not while a trainer runs, unless
#       --restart); fetch uv U if missing; make the venv V with Python P (uv downloads it: the
#       TPU images' python3 is 3.10) unless V already has P; then install the tested versions:
#       uv pip install -c D/constraints.txt -e 'D[E]' (E: --extras, default tpu).
#   worker.sh start [--venv=V --log-file=F --env=K=V ... --no-distributed --restart] -- TRAINER FLAGS
#       start `python -m dipaco_jax.main TRAINER FLAGS` with nohup, appending to F, unless one
#       is already running (--restart stops it first); with DIPACO_DISTRIBUTED=1 unless
#       --no-distributed (the elastic driver on the Ray head is one process).
#   worker.sh stop [--log-file=F]
#       stop the trainer that start began.
# Relative paths are under the worker's home. The pid sits next to the log (F without .log + .pid).

set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

mode=${1:-}
(($#)) && shift
parse_flags "$@"

home_path() { case $1 in /*) echo "$1" ;; *) echo "$HOME/$1" ;; esac; }

this_tree=$(dirname "$LAUNCH_DIR")
venv=$(home_path "$VENV")
log=$(home_path "$LOG_FILE")
pidfile="${log%.log}.pid"

# True when the pid file names a live trainer (and not a recycled pid).
trainer_pid() {
  local pid
  [[ -f $pidfile ]] || return 1
  pid=$(cat "$pidfile")
  [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || return 1
  if [[ -r /proc/$pid/cmdline ]] && ! grep -qa dipaco_jax.main "/proc/$pid/cmdline"; then
    return 1
  fi
  echo "$pid"
}

stop_trainer() {
  local pid i
  pid=$(trainer_pid) || { note "no trainer running on $(hostname)"; return 0; }
  note "stopping trainer pid $pid on $(hostname)"
  kill "$pid"
  for ((i = 0; i < 60; i++)); do
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.5
  done
  kill -9 "$pid" 2>/dev/null || true
}

# The pinned uv (--uv-version), fetched with its official installer the first time.
uv_path() {
  local dir="$HOME/.dipaco_uv/$UV_VERSION"
  if [[ ! -x $dir/uv ]]; then
    note "installing uv $UV_VERSION into $dir on $(hostname)"
    mkdir -p "$dir"
    curl -LsSf "https://astral.sh/uv/$UV_VERSION/install.sh" | env UV_UNMANAGED_INSTALL="$dir" sh >&2
    [[ -x $dir/uv ]] || die "the uv installer left no $dir/uv on $(hostname)"
  fi
  echo "$dir/uv"
}

# True when the venv exists and runs the wanted Python (a venv made by an older setup, with the
# image's Python 3.10, is made again).
venv_has_python() {
  [[ -x $venv/bin/python && -f $venv/pyvenv.cfg ]] &&
    grep -Eq "^version(_info)? *= *${PYTHON_VERSION//./\\.}(\\.|$)" "$venv/pyvenv.cfg"
}

install() {
  local target pip_args=() pid uv
  [[ $EXTRAS =~ ^[a-z][a-z0-9_,-]*$ ]] || die "--extras=$EXTRAS: need extras like tpu or tpu,elastic"
  target=$(home_path "$REMOTE_DIR")
  if pid=$(trainer_pid); then
    if ((!RESTART)); then
      note "trainer pid $pid still runs on $(hostname): $target left as is (--restart replaces it)"
      [[ $this_tree == "$target" ]] || rm -rf "$this_tree"
      return 0
    fi
    stop_trainer
  fi
  if [[ $this_tree != "$target" ]]; then
    rm -rf "$target"
    mv "$this_tree" "$target"
  fi
  [[ -f $target/constraints.txt ]] ||
    die "$target/constraints.txt is missing: the workers install the versions the tests ran with"
  uv=$(uv_path)
  if venv_has_python; then
    note "venv $venv has Python $PYTHON_VERSION: reusing it"
  else
    note "making venv $venv with Python $PYTHON_VERSION"
    rm -rf "$venv"
    "$uv" venv -q --python "$PYTHON_VERSION" "$venv"
  fi
  [[ -n $PIP_ARGS ]] && read -r -a pip_args <<<"$PIP_ARGS"
  "$uv" pip install -q --python "$venv/bin/python" -c "$target/constraints.txt" \
    ${pip_args[@]+"${pip_args[@]}"} -e "${target}[$EXTRAS]"
  note "installed $target into $venv on $(hostname)"
}

start() {
  local pid
  if pid=$(trainer_pid); then
    if ((!RESTART)); then
      note "trainer pid $pid already runs on $(hostname): left alone (--restart replaces it)"
      return 0
    fi
    stop_trainer
  fi
  [[ -x $venv/bin/python ]] || die "no venv at $venv on $(hostname): run setup.sh first"
  mkdir -p "$(dirname "$log")"
  cd "$this_tree"
  printf '=== %s start on %s: %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$(hostname)" \
    "$(shell_join ${TRAINER_ARGS[@]+"${TRAINER_ARGS[@]}"})" >>"$log"
  # The trainer calls jax.distributed.initialize() when DIPACO_DISTRIBUTED=1; on TPU VMs it finds
  # the coordinator, process count and id by itself.
  nohup env DIPACO_DISTRIBUTED="$DISTRIBUTED" ${TRAIN_ENV_LIST[@]+"${TRAIN_ENV_LIST[@]}"} \
    "$venv/bin/python" -m dipaco_jax.main ${TRAINER_ARGS[@]+"${TRAINER_ARGS[@]}"} \
    >>"$log" 2>&1 </dev/null 3>&- &
  echo $! >"$pidfile"
  note "started trainer pid $! on $(hostname); log $log"
}

case $mode in
  install) install ;;
  start) start ;;
  stop) stop_trainer ;;
  *) die "usage: worker.sh install|start|stop [flags] [-- trainer flags]" ;;
esac
