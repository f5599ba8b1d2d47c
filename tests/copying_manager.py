"""An example checkpoint manager (checkpoint.custom_manager_class: copying_manager.CopyingCheckpointManager): it saves
and loads as the default manager does, and copies each published checkpoint to SAVE_copies/ as well, with its tracker
file, so the copies are a save directory of their own (e.g. for a second file system)."""

import os
import shutil

import torch

import checkpoint


class CopyingCheckpointManager:
    """Bridge's CheckpointManager protocol: __init__(config), save, load, finalize_async_saves."""

    def __init__(self, checkpoint_config):
        self.default = checkpoint.DefaultCheckpointManager(checkpoint_config)
        self.save_dir = checkpoint_config.save
        self.copies = f"{checkpoint_config.save}_copies" if checkpoint_config.save else None
        self.loads = []

    def save(self, ctx, callback_manager=None):
        self.default.save(ctx, callback_manager)
        self._copy_published()  # a synchronous save is published now; an async one in finalize_async_saves

    def load(self, ctx):
        self.loads.append(ctx.state.cfg.checkpoint.load)
        return self.default.load(ctx)

    def finalize_async_saves(self, state, blocking=False, terminate=False):
        self.default.finalize_async_saves(state, blocking, terminate)
        self._copy_published()

    def _copy_published(self):
        """Rank 0 copies the newest published checkpoint once, then its tracker file (so the copy is published last)."""
        step = checkpoint.tracked_iteration(self.save_dir) if self.save_dir else None
        if step is None or torch.distributed.get_rank() != 0:
            return
        target = checkpoint.iter_dir(self.copies, int(step))
        if not os.path.isdir(target):
            shutil.copytree(checkpoint.iter_dir(self.save_dir, int(step)), target)
            for name in os.listdir(self.save_dir):  # the tracker files (and the progress log)
                if os.path.isfile(os.path.join(self.save_dir, name)):
                    shutil.copy(os.path.join(self.save_dir, name), os.path.join(self.copies, name))


class NoLoad:
    """A class that is not a checkpoint manager: it has no load()."""

    def __init__(self, checkpoint_config):
        pass

    def save(self, ctx, callback_manager=None):
        pass

    def finalize_async_saves(self, state, blocking=False, terminate=False):
        pass
