"""Fit the configured router and write the run's shards; print its quality report.

  python -m dipaco_jax.route --config=configs/tiny.py --workdir=DIR \
      --config.routing.router=kmeans

Shard writing in parallel, as N processes on any machines sharing the workdir's storage
(each tokenizes, routes and writes 1/N of the documents; process 0 waits for the others'
parts, joins them and writes the report; a crashed process is rerun alone):

  for i in 0 1 2 3; do python -m dipaco_jax.route --config=... --workdir=gs://BUCKET/run \
      --num_processes=4 --process_index=$i & done; wait
"""

from absl import flags

from dipaco_jax import cli

_NUM_PROCESSES = flags.DEFINE_integer(
  "num_processes",
  1,
  "Processes writing the shards together (each writes 1/N of them).",
  lower_bound=1,
)
_PROCESS_INDEX = flags.DEFINE_integer(
  "process_index",
  0,
  "This process's index in [0, num_processes); 0 joins the parts.",
  lower_bound=0,
)


def main(argv):
  config, workdir = cli.start(argv)
  if _PROCESS_INDEX.value >= _NUM_PROCESSES.value:
    raise flags.ValidationError(
      f"--process_index={_PROCESS_INDEX.value} must be < --num_processes={_NUM_PROCESSES.value}."
    )
  from dipaco_jax import routing  # pylint: disable=g-import-not-at-top

  print(
    routing.route_run(
      config,
      workdir,
      process_index=_PROCESS_INDEX.value,
      num_processes=_NUM_PROCESSES.value,
    )
  )


if __name__ == "__main__":
  cli.run(main)
