"""The reward model's side of the hybrid worker: scores this rank's finished trajectories after the
agent loop (batched), on the rank that ran them. Its weights come to the device only for that
(phase `reward_model` of the mode machine, with the bytes moved) and leave right after, so the
engine's generation never shares the device with them."""

from __future__ import annotations

from hybridrl.data.trajectory import TrajectoryStatus

SCORED = (TrajectoryStatus.COMPLETED, TrajectoryStatus.TRUNCATED)


class RewardModelMixin:
    """Mixed into `HybridWorker`; expects self.cfg, self.ctx, self.modes, self.tokenizer, self.owns_engine."""

    reward_model = None

    def _build_reward_model(self):
        rm = self.cfg.reward_model
        if not rm.enabled or not self.owns_engine:
            return None
        from hybridrl.reward.model_scorer import RewardModelScorer

        return RewardModelScorer(rm.path, component=rm.component, device=self.ctx.device, batch_size=rm.batch_size,
                                 offload=rm.offload, policy_tokenizer_dir=self.cfg.model.path)

    def _score_with_reward_model(self, trajectories) -> None:
        """Add the reward model's component to every scored trajectory (total += weight * score)."""
        if self.reward_model is None:
            return
        chosen = [t for t in trajectories if t.status in SCORED]
        if not chosen:
            return
        scorer, weight = self.reward_model, self.cfg.reward_model.weight
        with self.modes.phase("reward_model") as rec:
            rec.bytes_moved = scorer.to_device()
            try:
                scores = scorer.score_ids(scorer.token_rows([t.prompt_ids + t.response_ids for t in chosen],
                                                            self.tokenizer))
            finally:
                rec.bytes_moved += scorer.release()
        for traj, score in zip(chosen, scores):
            traj.rewards[scorer.component] = float(score)
            traj.reward_evaluators[scorer.component] = scorer.evaluator
            traj.reward += weight * float(score)

    def _reward_model_memory(self) -> dict:
        return {} if self.reward_model is None else {"reward_model_bytes_resident": self.reward_model.resident_bytes()}
