"""Logical → mesh rules, strategy presets, sharded init, and introspection."""
from triax.sharding.partition import (AbstractModel, abstract_model, activation_sharding,
                                      batch_sharding, init_params, param_shardings)
from triax.sharding.rules import (STRATEGIES, Rules, ShardingError, Strategy, StrategyKind,
                                  get_strategy)

__all__ = ["AbstractModel", "Rules", "STRATEGIES", "ShardingError", "Strategy", "StrategyKind",
           "abstract_model", "activation_sharding", "batch_sharding", "get_strategy",
           "init_params", "param_shardings"]
