"""Offline routing of documents to paths (paper §2.4, §7.2, §7.3) and test-time re-routing.

The public names of the subpackage; the trainer, evaluation, serving and the
CLIs import only these. One module per concept:

  features        θ̄'s mean last-block hidden state over a document's prefix
  kmeans          k-means and product k-means in JAX
  discriminative  logistic regression on the best-path labels, calibrated bias
  router          a saved router (kmeans | product_kmeans | linear) and its fits
  assignment      a run's router over paths -> the shard assignment of documents
  scoring         per-token log-likelihoods of sequences under chosen paths
  phases          phase-0 router, the discriminative schedule and its re-fit
  rerouting       re-routing every W tokens with a test-time router (§2.4.3)
  report          shard sizes, paths x domains, purity, NMI
  specialisation  every path on every path's held-out shard, routed vs random vs oracle
"""

from dipaco_jax.routing import report
from dipaco_jax.routing import rerouting
from dipaco_jax.routing.assignment import PathRouter
from dipaco_jax.routing.assignment import RouterAssignment
from dipaco_jax.routing.assignment import collect
from dipaco_jax.routing.assignment import document_stream
from dipaco_jax.routing.assignment import hash_ids
from dipaco_jax.routing.assignment import make_assignment
from dipaco_jax.routing.assignment import router_grid
from dipaco_jax.routing.features import FeatureExtractor
from dipaco_jax.routing.features import check_prefix_len
from dipaco_jax.routing.features import extractor_from_config
from dipaco_jax.routing.features import pad_rows
from dipaco_jax.routing.phases import ROUTER_DIR
from dipaco_jax.routing.phases import discriminative_steps
from dipaco_jax.routing.phases import fit_discriminative_router
from dipaco_jax.routing.phases import load_phase_router
from dipaco_jax.routing.phases import phase0_grid
from dipaco_jax.routing.phases import phase0_router
from dipaco_jax.routing.phases import route_run
from dipaco_jax.routing.phases import router_dir
from dipaco_jax.routing.phases import router_split_blocks
from dipaco_jax.routing.phases import score_len
from dipaco_jax.routing.phases import score_router_split
from dipaco_jax.routing.phases import shard_dir
from dipaco_jax.routing.router import Router
from dipaco_jax.routing.scoring import PathScorer
from dipaco_jax.routing.scoring import eval_seq_len
