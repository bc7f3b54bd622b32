"""Tasks: one small file each (a `Task` subclass decorated with `@register_task`, in a module named
after the task), or any `package.module:Class` named in `task.name`."""

from hybridrl.data.episode import EpisodeOutcome, TaskInstance
from hybridrl.envs.tasks.base import Task, chat, split_of, unique_instances
from hybridrl.envs.tasks.registry import get_task, register_task, task_names

__all__ = ["EpisodeOutcome", "Task", "TaskInstance", "chat", "get_task", "register_task", "split_of", "task_names",
           "unique_instances"]
