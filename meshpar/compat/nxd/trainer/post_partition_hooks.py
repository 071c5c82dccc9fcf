"""``neuronx_distributed.trainer.post_partition_hooks``: callables NxD runs once a pipeline has been partitioned.
``NxDPPModel`` runs the registered ones (``trainer.hooks``) when its stages are built: at construction, or at the
first step of a pipeline traced then; hooks registered later are run by whoever calls ``execute_all_hooks`` (as in
NxD)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any


class PostPartitionHooks:
    def __init__(self) -> None:
        self.hooks: list[dict[str, Any]] = []

    def register_post_partition_hook(
        self, callable_function: Callable[..., Any], func_args: tuple = (), func_kwargs: dict | None = None
    ) -> None:
        if not callable(callable_function):
            raise ValueError("callable_function must be a callable object")
        function = partial(callable_function, *func_args, **(func_kwargs or {}))
        self.hooks.append({"function": function, "name": callable_function.__name__})

    def execute_all_hooks(self, model: Any = None) -> list[Any]:
        """Run every hook once (``filter_to_local_parameter_group`` gets the model) and forget them."""
        outputs = []
        for hook in self.hooks:
            if hook["name"] == "filter_to_local_parameter_group":
                if model is None:
                    raise ValueError("filter_to_local_parameter_group needs the model")
                outputs.append(hook["function"](model=model))
            else:
                outputs.append(hook["function"]())
        self.hooks.clear()
        return outputs


__all__ = ["PostPartitionHooks"]
