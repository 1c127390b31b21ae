"""The command's own Ray cluster ends with the command, however it ends (SIGKILL included).

`start(temp_dir)`, called once ray.init has started the cluster's processes (the
command's children), runs this module as a watcher process: it notes those
processes and, every second, their descendants (agents, actor workers), and
blocks on a pipe that only the command holds open. The pipe ends when the
command exits, killed or not; the watcher then kills every process it noted
that still runs (Ray's own shutdown leaves the agents behind when the command is
killed: they outlived it by 92 s and more, one listening on loopback), and any
process with a file open in the cluster's temporary folder (one the raylet started
just before it died), then removes that folder (sockets, logs, session files;
owner-only: 0700).
`stop()` is the command's normal end: ray.shutdown, then the same, waited for.

    python -m dipaco_jax.runtime.elastic.reaper TEMP_DIR PID...   (started by `start`)
"""

import os
import select
import shutil
import subprocess
import sys
import tempfile

import psutil

PREFIX = "dipaco_ray_"  # The cluster's temporary folder: <system temp>/dipaco_ray_XXXX.
_POLL_S = 0.5
_watcher: dict = {}  # This process's watcher: {"proc": Popen, "pipe": write end, "dir": str}.


def temp_dir() -> str:
  """Ray's temp dir for the cluster, in a new owner-only (0700) folder; short (socket paths).

  Ray makes its own folders world-writable: the folder around them keeps others out.
  """
  return os.path.join(tempfile.mkdtemp(prefix=PREFIX), "ray")


def start(temp: str, before: set[int]) -> None:
  """Starts the watcher over this process's children not in `before` (those ray.init started)."""
  roots = [p.pid for p in psutil.Process().children() if p.pid not in before]
  read, write = os.pipe()
  proc = subprocess.Popen(
    [sys.executable, "-m", __name__, temp, *map(str, roots)],
    stdin=read,
    start_new_session=True,  # Ctrl-C in the terminal reaches the command, not its watcher.
    close_fds=True,
  )
  os.close(read)
  _watcher.update(proc=proc, pipe=write, dir=temp)


def stop(timeout_s: float = 30.0) -> None:
  """The command's end: the watcher kills what is left of the cluster and removes its folder."""
  if not _watcher:
    return
  os.close(_watcher.pop("pipe"))
  try:
    _watcher.pop("proc").wait(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    pass
  _watcher.clear()


def _note(procs: dict[tuple[int, float], psutil.Process]) -> None:
  """Adds the live descendants of the noted processes (keyed by pid and start time)."""
  for p in list(procs.values()):
    try:
      for c in p.children(recursive=True):
        procs.setdefault((c.pid, c.create_time()), c)
    except psutil.Error:  # Ended meanwhile.
      pass


def _using(folder: str, spare: set[int]) -> list[psutil.Process]:
  """This user's processes with a file open under `folder` (Ray's logs: every cluster process).

  Finds the ones orphaned before they were noted (the raylet dies with the command, and
  its last-started workers with it, out of the noted tree).
  """
  me, out = os.getuid(), []
  for p in psutil.process_iter(["uids"]):
    try:
      if p.info["uids"] and p.info["uids"].real == me and p.pid not in spare:
        if any(f.path.startswith(folder + os.sep) for f in p.open_files()):
          out.append(p)
    except psutil.Error:
      pass
  return out


def _kill(procs: dict[tuple[int, float], psutil.Process], folder: str, command: int) -> None:
  """Kills the noted processes still running and any that use `folder`, until none is left.

  Never this watcher or the `command` (a normal end waits for the watcher, Ray's log
  files still open).
  """
  for _ in range(10):
    _note(procs)
    alive = []
    for (_, started), p in procs.items():
      try:
        if p.is_running() and p.create_time() == started:  # Not a reused pid.
          alive.append(p)
      except psutil.Error:
        pass
    alive += _using(folder, {os.getpid(), command})
    if not alive:
      return
    for p in alive:
      try:
        p.kill()
      except psutil.Error:
        pass
    psutil.wait_procs(alive, timeout=5)


def main(argv: list[str]) -> None:
  temp, pids, command = argv[1], [int(a) for a in argv[2:]], os.getppid()
  procs = {}
  for pid in pids:
    try:
      p = psutil.Process(pid)
      procs[(pid, p.create_time())] = p
    except psutil.Error:
      pass
  while True:
    _note(procs)
    ready, _, _ = select.select([sys.stdin], [], [], _POLL_S)
    if ready and not os.read(sys.stdin.fileno(), 1):  # EOF: the command has exited.
      break
  folder = os.path.dirname(temp)  # The owner-only folder start's temp dir is in.
  _kill(procs, folder, command)
  shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
  main(sys.argv)
