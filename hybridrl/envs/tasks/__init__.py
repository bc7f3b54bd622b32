"""Tasks: one small file each (a `Task` subclass decorated with `@register_task`)."""

from hybridrl.envs.tasks.base import EpisodeOutcome, Task, TaskInstance
from hybridrl.envs.tasks.registry import get_task, register_task, task_names

__all__ = ["EpisodeOutcome", "Task", "TaskInstance", "get_task", "register_task", "task_names"]
