"""Routed evaluation of a run's latest checkpoint (once per sequence and every W tokens).

python -m dipaco_jax.evaluate --config=configs/tiny.py --workdir=DIR
"""

from absl import flags

from dipaco_jax import cli

_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")


def main(argv):
  config, workdir = cli.start(argv)
  from dipaco_jax import evaluation  # pylint: disable=g-import-not-at-top

  print(evaluation.evaluate_and_write(config, workdir, step=_STEP.value))


if __name__ == "__main__":
  cli.run(main)
