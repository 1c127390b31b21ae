r"""DiPaCo 2x4: 8 paths of 150M, 0.5B parameters in all (paper Fig. 9: 14.86 ppl).

First θ̄, the dense model every path forks from (24k steps; configs/dense_150m.py):

  python -m dipaco_jax.main --config=configs/dense_150m.py --workdir=gs://BUCKET/dense_150m_24k \
    --config.dipaco.outer_steps=24 \
    --config.data.tfds_data_dir=gs://BUCKET/tfds --config.data.vocab_path=gs://BUCKET/t5_32k.model

then this run (config.dipaco.init_from is required):

  python -m dipaco_jax.main --config=configs/dipaco_2x4.py --workdir=gs://BUCKET/dipaco_2x4 \
    --config.dipaco.init_from=gs://BUCKET/dense_150m_24k \
    --config.data.tfds_data_dir=gs://BUCKET/tfds --config.data.vocab_path=gs://BUCKET/t5_32k.model

Levels (inferred; the paper gives no split): see config_defaults.paper_grid.
Routing: product k-means phase-0 shards on θ̄'s prefix features, then one
discriminative re-shard after outer step 107 (16,050 of 64,050 inner steps)
with the LR schedule restarted; the reasons: config_defaults.paper_fork.
"""

from dipaco_jax import config_defaults


def get_config():
  return config_defaults.paper_grid(2, 4)
