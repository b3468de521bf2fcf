"""Data-parallel integration: detect how a model is wrapped and pick a strategy for each MLP."""

from .detect import Wrapping, detect_wrapping
from .strategies import STRATEGIES, STRATEGY_NAMES, Strategy, strategy_for, validate_forced

__all__ = ["Wrapping", "detect_wrapping", "Strategy", "STRATEGIES", "STRATEGY_NAMES", "strategy_for", "validate_forced"]
