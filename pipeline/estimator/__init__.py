"""DEPO difficulty estimator: the model, its trainer, its online loop (replay, calibration), and the model router.

Paper: "Difficulty-Estimated Policy Optimization". The pure losses and the drop rule are in
``pipeline.algorithms.depo``; ``winnow train-estimator`` (``pipeline.stages.train_estimator``)
pre-trains the estimator on a curation. Importing this package does not import
transformers; the model classes load it when built.
"""

from pipeline.estimator.model import DifficultyEstimator, unpack_minilm
from pipeline.estimator.online import OnlineEstimator, Prediction
from pipeline.estimator.replay import ReplayBuffer
from pipeline.estimator.router import RoutedEngine, estimator_predictor, route
from pipeline.estimator.train import EstimatorTrainer, spearman_correlation

__all__ = [
    "DifficultyEstimator",
    "EstimatorTrainer",
    "OnlineEstimator",
    "Prediction",
    "ReplayBuffer",
    "RoutedEngine",
    "estimator_predictor",
    "route",
    "spearman_correlation",
    "unpack_minilm",
]
