"""Causal scoring (the ``causal_scoring`` engine purpose): offline perplexity and per-token
log-probabilities over fixed windows. ``windows`` plans which tokens each window reads and scores,
``inputs`` normalises what callers pass, ``score_core`` runs the Program over the windows and
``report`` holds the results and their JSON form. Reach it through ``Engine.score``."""

from ninfer.scoring.inputs import InvalidScoringInput, ScoreInput
from ninfer.scoring.report import Aggregate, ScoreReport, ScoreSettings, TextScore
from ninfer.scoring.windows import InvalidScoringOptions, Window, plan_windows

__all__ = ["Aggregate", "InvalidScoringInput", "InvalidScoringOptions", "ScoreInput", "ScoreReport",
           "ScoreSettings", "TextScore", "Window", "plan_windows"]
