"""Routed evaluation of a run's latest checkpoint (once per sequence and every W tokens).

python -m dipaco_jax.evaluate --workdir=DIR [--config.eval.rerouters=linear,transformer]

The config is the run's saved <workdir>/config.json unless --config is given;
--config.a.b=v overrides apply on top (cli.py). The transformer re-router (the
paper's) fine-tunes θ̄ and takes minutes on a CPU: it runs only when listed.
"""

from absl import flags

from dipaco_jax import cli

flags.adopt_module_key_flags(cli)  # --help lists --config, --workdir, --verbose_errors.
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")


def main(argv):
  config, workdir = cli.start(argv)
  from dipaco_jax import evaluation  # pylint: disable=g-import-not-at-top

  print(evaluation.evaluate_and_write(config, workdir, step=_STEP.value))


if __name__ == "__main__":
  cli.run(main, saved_config=True)
