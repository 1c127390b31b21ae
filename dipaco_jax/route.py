"""Fit the configured router and write the run's shards; print its quality report.

  python -m dipaco_jax.route --config=configs/tiny.py --workdir=DIR \
      --config.routing.router=kmeans
"""

from dipaco_jax import cli


def main(argv):
  config, workdir = cli.start(argv)
  from dipaco_jax import routing  # pylint: disable=g-import-not-at-top

  print(routing.route_run(config, workdir))


if __name__ == "__main__":
  cli.run(main)
