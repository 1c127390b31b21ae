"""Native libraries' start-up lines (libtpu, TensorFlow, CUDA) kept off a healthy run's console.

Two sources print error-level lines on a host without the accelerator they look for:

  * jax starts every backend plugin it finds unless told which platforms to use; with libtpu
    installed (the `tpu` extra) a CPU host prints `E0000 ... unexpected worker hostname` and a
    source-location trace. `choose_platforms()` names the platforms when the host has no TPU
    chip and no NVIDIA device (JAX_PLATFORMS=cpu, inherited by the processes it starts: shard
    writers, Ray actors); JAX_PLATFORMS or jax_platforms set by the user are kept as given.
  * TensorFlow (the data front end only tokenizes) prints `failed call to cuInit` and its
    oneDNN/CUDA notices while it starts, from C++, before any log level applies.
    `quiet_fd2()` holds the process's stderr while it starts and writes back every line that
    is not one of those notices (all of them with --library_log_level=info or debug).
"""

import contextlib
import glob
import os
import re
import sys
import tempfile

# Start-up notices of native libraries on a host without their device.
_NOISE = re.compile(
  "|".join(
    (
      r"All log messages before absl::InitializeLog\(\) is called",
      r"Logging before InitGoogle\(\)",
      r"oneDNN custom operations are on",
      r"Could not find cuda drivers",
      r"failed call to cuInit",
      r"Unable to register cu(DNN|FFT|BLAS) factory",
      r"computation placer already registered",
      r"TF-TRT Warning",
      r"could not determine TPU (accelerator type|worker hostnames)",
      r"This TensorFlow binary is optimized to use available CPU instructions",
      r"To enable the following instructions",
    )
  )
)
_GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips (jax's hardware_utils lists their device ids).


def _has_tpu() -> bool:
  """A TPU chip on this host's PCI bus, as jax itself decides (False where it cannot tell)."""
  try:
    from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top

    return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
  except Exception:  # pylint: disable=broad-except
    # Without jax's table: any Google PCI device that is not a NIC counts as a TPU.
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
      try:
        with open(vendor) as f:
          if f.read().strip() == _GOOGLE_PCI_VENDOR:
            return True
      except OSError:
        continue
    return False


def _has_gpu() -> bool:
  """An NVIDIA (CUDA) or AMD (ROCm) device node: jax's GPU plugins may use it."""
  return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")


def choose_platforms() -> str | None:
  """Runs jax on the CPU alone where the host has no accelerator; the platforms it set, or None.

  Call before any backend starts. A user's JAX_PLATFORMS (or jax_platforms) is kept.
  """
  import jax  # pylint: disable=g-import-not-at-top

  if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms:
    return None
  if "JAX_FORCE_TPU_INIT" in os.environ or _has_tpu() or _has_gpu():
    return None
  os.environ["JAX_PLATFORMS"] = "cpu"  # Child processes (shard writers, Ray actors) too.
  jax.config.update("jax_platforms", "cpu")
  return "cpu"


def is_noise(line: str) -> bool:
  """A native library's start-up notice (see the module docstring), or a trace line of one."""
  return bool(_NOISE.search(line))


def _verbose() -> bool:
  # cli.quiet_libraries sets TF_CPP_MIN_LOG_LEVEL=0 for --library_log_level=info|debug.
  return os.environ.get("TF_CPP_MIN_LOG_LEVEL", "1") == "0"


@contextlib.contextmanager
def quiet_fd2():
  """Holds fd 2 while native code starts; writes back its lines but the start-up notices.

  On an exception every held line is written back. Where fd 2 cannot be redirected (no such
  descriptor), does nothing.
  """
  try:
    sys.stderr.flush()
    saved = os.dup(2)
  except (OSError, ValueError):
    yield
    return
  keep_all = _verbose()
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    failed = False
    try:
      yield
    except BaseException:
      failed = True
      raise
    finally:
      try:
        sys.stderr.flush()
      except (OSError, ValueError):
        pass
      os.dup2(saved, 2)
      os.close(saved)
      held.seek(0)
      text = held.read().decode("utf-8", "replace")
      lines = text.splitlines()
      if not (keep_all or failed):
        lines = [l for l in lines if not is_noise(l)]
      if lines:
        sys.stderr.write("\n".join(lines) + "\n")
        sys.stderr.flush()
