"""Entry point: `python -m dipaco_jax.main --config=configs/tiny.py --workdir=DIR`.

Kept tiny on purpose: everything it calls is importable from tests and colab.
"""

from absl import flags

from dipaco_jax import cli

flags.adopt_module_key_flags(cli)  # --help lists --config, --workdir, --verbose_errors.


def main(argv):
  config, workdir = cli.start(argv)  # Validated before the workdir is touched.
  # Imported after jax.distributed is up: the trainer touches devices.
  from dipaco_jax import train  # pylint: disable=g-import-not-at-top

  train.train_and_evaluate(config, workdir)  # The full config goes to <workdir>/config.json.


if __name__ == "__main__":
  cli.run(main)
