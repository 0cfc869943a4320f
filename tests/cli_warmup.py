"""Imported by the CLI fork server (``flowkit._PRELOAD``) after the modules it lists: work that every CLI
process of the suite would do once for itself, done once per test worker instead (forked children inherit
it). Measured in a CLI child on this machine:

* the first policy log (``mlflow_runs.log_policy``): MLflow checks a logged model's pinned requirements against
  the installed packages, and the first check in a process maps every installed distribution to its modules
  (``importlib.metadata``); with it, the pyfunc flavour's imports. 1.30 CPU-s, 0.37 with this done.
* the household corpus a tiny model's word tokenizer is keyed by (``envs.corpus_digest``), played once per
  process and suite seed (the tests' suites use seed 0) unless the run's data folder remembers its digest,
  which a test's fresh folder does not: 1.0 CPU-s.
"""

import mlflow.models.utils  # noqa: F401
import mlflow.pyfunc  # noqa: F401
from mlflow.utils import requirements_utils

from horizonrl.envs.household import HouseholdSuite

requirements_utils._init_packages_to_modules_map()  # cached for the process (and its forked children)
HouseholdSuite(0).corpus()  # cached for the process the same way (household._CORPORA)
