"""The credit audit (``horizonrl audit``, docs/algorithms.md §8): how well each advantage estimator tracks the
Monte Carlo advantage of the very decisions it scores. Play groups as training does, draw decision points
(``points``), estimate the truth at each from continuations (``truth``), score every estimator against it
(``statistics``, ``scores``); ``policy`` resolves what is audited, ``page`` writes the generated page."""
