r"""Fit the configured router and write the run's shards; print its quality report.

  python -m dipaco_jax.route --config=configs/tiny.py --workdir=DIR \
      --config.routing.router=kmeans

Shard writing in parallel: N independent processes, on any machines that share the workdir's
storage, each tokenize, route and write 1/N of the documents; process 0 waits for the
others' parts, joins them and writes the report. A crashed process is rerun alone.

  for i in 0 1 2 3; do python -m dipaco_jax.route --config=... --workdir=gs://BUCKET/run \
      --num_processes=4 --process_id=$i & done; wait

Without --config it reads the run's saved <workdir>/config.json (a run that has
trained); before training, give --config (cli.py).
"""

from absl import flags

from dipaco_jax import cli
from dipaco_jax.io import distributed

flags.adopt_module_key_flags(cli)  # --help lists --config, --workdir, --verbose_errors.


def main(argv):
  config, workdir = cli.start(argv)
  process_index, num_processes = distributed.process_index_and_count()
  from dipaco_jax import routing  # pylint: disable=g-import-not-at-top

  print(
    routing.route_run(config, workdir, process_index=process_index, num_processes=num_processes)
  )
  if process_index == 0:
    from dipaco_jax.routing import phases  # pylint: disable=g-import-not-at-top

    router = phases.router_dir(workdir, 0)
    print(
      f"\nwrote: the shards in {phases.shard_dir(config, workdir, 0)}; the report "
      f"{router}/{phases.REPORT_FILE}"
      + ("" if config.routing.router == "random" else f"; the router in {router}")
      + f". Train on them: python -m dipaco_jax.main --config=... --workdir={workdir} (the "
      "same --config flags)."
    )


if __name__ == "__main__":
  cli.run(main, saved_config=True)
