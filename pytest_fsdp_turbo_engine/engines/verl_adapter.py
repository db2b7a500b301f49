"""verl's own engines under the harness: a case with backend "verl:<name>" builds the engine that
verl's EngineRegistry holds under <name> (verl:fsdp2, verl:fsdp_turbo, or a downstream subclass
registered there) and drives it through verl's public engine API, as verl's trainer does:
initialize, infer_batch for log-probabilities, forward_backward_batch with verl's own PPO loss,
optimizer_step, get_per_tensor_param for the rollout. Nothing of ours is subclassed by the engine.

The harness's measurements reach verl's micro-batch loop through the loss function it hands verl
(MicroBatchProbe), never through an engine method. Imported only by ranks of verl cases.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from pytest_fsdp_turbo_contract.spec import EngineSpec, PPOSpec
from pytest_fsdp_turbo_contract.vocab import VERL_PREFIX, Capability, Dtype, SyncPolicy
from pytest_fsdp_turbo_engine.core.train_batch import TrainBatch

MODEL_TYPE = "language_model"  # verl's registry key for causal LMs with an LM head
FP32_MIXED_PRECISION = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}


def preload(kind: str) -> None:
    """What the warm parent's verl zygote imports for the ranks of one device kind: the platform
    shims first (verl resolves its platform while importing), then the modules a rank uses."""
    import importlib

    from pytest_fsdp_turbo_engine.verl_cpu_platform import prepare

    prepare(kind)
    for module in (
        "verl.trainer.config.config",
        "verl.workers.config",
        "verl.workers.engine",
        "verl.utils.tensordict_utils",
        "verl.workers.utils.padding",
        "verl.workers.utils.losses",
    ):
        importlib.import_module(module)
    # verl tells a vision-language checkpoint by its config class among an auto mapping's keys
    # (verl.utils.model), which imports every such model's config module: 0.3 s a rank, paid here
    from transformers import AutoModelForImageTextToText

    AutoModelForImageTextToText._model_mapping.keys()


class _InitialPolicy:
    """The reference policy of a 1-step run is the initial policy: before the step its log-probs
    are the policy's own, so no second verl engine is built for it."""


class VerlEngineAdapter:
    drives_micro_batches: ClassVar[bool] = (
        True  # verl runs its own micro-batch loop (forward_backward_batch)
    )

    def __init__(self, config: EngineSpec, device: torch.device):
        from pytest_fsdp_turbo_engine.verl_cpu_platform import prepare

        self.config, self.device = config, device
        self.model_overrides = prepare(device.type)  # CPU shims; nothing on cuda or npu
        self.name = config.backend.removeprefix(VERL_PREFIX)
        self.on_turbo = Capability.TURBO_CONFIG in config.capabilities
        self.engine: Any = None
        self.module: torch.nn.Module | None = None
        self.stepped = False
        self.micro_batch_rows = 0

    # --- build ----------------------------------------------------------------------------------
    def _configs(self, model_path: str) -> dict:
        from verl.trainer.config.config import CheckpointConfig
        from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

        cfg = self.config
        fp32 = cfg.dtype == Dtype.FP32
        shard = cfg.fsdp_size if cfg.fsdp_size < cfg.world_size // max(1, cfg.sp_size) else -1
        return {
            "model_config": HFModelConfig(
                path=model_path,
                override_config=dict(self.model_overrides),
                enable_gradient_checkpointing=False,
            ),
            "engine_config": FSDPEngineConfig(
                strategy="fsdp2",
                fsdp_size=shard,
                # an engine built on fsdp_turbo (verl's FSDP-Turbo, or a subclass) takes Ulysses
                # from turbo_config and refuses both
                ulysses_sequence_parallel_size=1 if self.on_turbo else cfg.sp_size,
                model_dtype="fp32",
                dtype="float32" if fp32 else "bfloat16",
                mixed_precision=FP32_MIXED_PRECISION if fp32 else None,
                use_torch_compile=False,
                use_dynamic_bsz=False,
                use_no_sync_for_gradient_accumulation=cfg.gradient_sync == SyncPolicy.DEFERRED,
                turbo_config=dict(cfg.turbo_config),
            ),
            "optimizer_config": FSDPOptimizerConfig(
                lr=cfg.lr,
                weight_decay=cfg.weight_decay,
                betas=(cfg.adam_beta1, cfg.adam_beta2),
                override_optimizer_config={"eps": cfg.adam_eps},
                clip_grad=cfg.grad_clip,
                total_training_steps=1,
            ),
            "checkpoint_config": CheckpointConfig(),
        }

    def build(self, model_path: str, *, trainable: bool = True):
        if not trainable:
            return _InitialPolicy()
        from verl.workers.engine import EngineRegistry

        self.engine = EngineRegistry.new(MODEL_TYPE, self.name, **self._configs(model_path))
        self.engine.initialize()
        self.module = self.engine.module
        return self.module

    # --- topology -------------------------------------------------------------------------------
    def data_parallel_rank(self) -> int:
        return self.engine.get_data_parallel_rank()

    def data_parallel_size(self) -> int:
        return self.engine.get_data_parallel_size()

    def data_parallel_group(self):
        return self.engine.get_data_parallel_group()

    def replicate_group(self):
        mesh = self.engine.device_mesh
        if mesh.ndim == 2 and mesh.size(0) > 1:
            return mesh.get_group(mesh.mesh_dim_names[0])
        return None

    # --- data -----------------------------------------------------------------------------------
    def _tensordict(self, input_ids: torch.Tensor, prompt_len: int, train: TrainBatch | None):
        """Our right-padded rows as verl's no-padding TensorDict. Every position is attended (as in
        our own engine); tokens after EOS only ever follow the ones that count."""
        from tensordict import TensorDict
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding

        rows, length = input_ids.shape
        response_len = length - prompt_len
        fields = {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "position_ids": torch.arange(length, device=input_ids.device).expand(rows, length),
            "prompts": input_ids[:, :prompt_len],
            "responses": input_ids[:, prompt_len:],
            "response_mask": train.mask
            if train is not None
            else torch.ones(rows, response_len, device=input_ids.device),
        }
        if train is not None:
            fields.update(
                old_log_probs=train.old_logprobs,
                advantages=train.advantages,
                ref_log_prob=train.ref_logprobs,
            )
        data = left_right_2_no_padding(TensorDict(fields, batch_size=[rows]))
        per_micro_batch = self.micro_batch_rows or rows
        tu.assign_non_tensor(
            data,
            temperature=1.0,
            use_dynamic_bsz=False,
            micro_batch_size_per_gpu=per_micro_batch,
            global_batch_size=rows * self.data_parallel_size(),
        )
        return data

    def forward_logprobs(self, input_ids, prompt_len, *, module=None, with_entropy=False):
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        if isinstance(module, _InitialPolicy) and self.stepped:
            raise RuntimeError("reference log-probs asked for after the step: the policy moved")
        data = self._tensordict(input_ids, prompt_len, None)
        tu.assign_non_tensor(data, calculate_entropy=with_entropy)
        with self.engine.eval_mode():
            output = self.engine.infer_batch(data)["model_output"]
        logprobs = no_padding_2_padding(output["log_probs"], data)
        entropy = no_padding_2_padding(output["entropy"], data) if with_entropy else None
        return logprobs, entropy

    # --- training -------------------------------------------------------------------------------
    def _actor_config(self, cfg: PPOSpec, global_rows: int):
        from verl.workers.config import FSDPActorConfig

        return FSDPActorConfig(
            strategy="fsdp2",
            ppo_mini_batch_size=global_rows,
            ppo_micro_batch_size_per_gpu=self.micro_batch_rows,
            rollout_n=1,
            clip_ratio=cfg.clip_ratio,
            clip_ratio_low=cfg.clip_ratio,
            clip_ratio_high=cfg.clip_ratio,
            clip_ratio_c=cfg.clip_ratio_c,
            loss_agg_mode="token-mean",
            entropy_coeff=cfg.entropy_coef,
            use_kl_loss=True,
            kl_loss_coef=cfg.kl_coef,
            kl_loss_type="low_var_kl",
            use_torch_compile=False,
        )

    def forward_backward(self, batch: TrainBatch, tokens: float, cfg: PPOSpec, probe) -> None:
        """verl's forward_backward_batch with verl's PPO loss; the probe sees every micro-batch."""
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.losses import ppo_loss
        from verl.workers.utils.padding import no_padding_2_padding

        if batch.size % cfg.micro_batches:
            raise ValueError(
                f"micro_batches: {batch.size} rows per rank do not split into {cfg.micro_batches}"
                " equal micro-batches, which verl's fixed micro-batch size needs"
            )
        self.micro_batch_rows = batch.size // cfg.micro_batches
        actor = self._actor_config(cfg, batch.size * self.data_parallel_size())
        data = self._tensordict(batch.input_ids, batch.prompt_len, batch)
        tu.assign_non_tensor(data, calculate_entropy=True)

        def loss_function(model_output, data, dp_group=None):  # verl passes these by name
            micro_batch = data
            logprobs = no_padding_2_padding(model_output["log_probs"], micro_batch)
            entropy = no_padding_2_padding(model_output["entropy"], micro_batch)
            fields = micro_batch.select(
                "response_mask", "old_log_probs", "advantages", "ref_log_prob"
            ).to_padded_tensor()
            rows = TrainBatch(
                input_ids=logprobs,  # not read by the probe
                prompt_len=batch.prompt_len,
                mask=fields["response_mask"],
                advantages=fields["advantages"],
                old_logprobs=fields["old_log_probs"],
                ref_logprobs=fields["ref_log_prob"],
            )
            # verl's loss pads model_output's log-probabilities itself: the harness's hook goes on
            # those, their gradient padded the same way
            unpadded = model_output["log_probs"]
            probe.loss_computed(
                logprobs,
                entropy,
                rows,
                gradient_of=(unpadded, lambda grad: no_padding_2_padding(grad, micro_batch)),
            )
            return ppo_loss(actor, model_output, micro_batch, dp_group)

        with self.engine.train_mode(zero_grad_on_exit=False):
            self.engine.forward_backward_batch(data, loss_function)

    def optimizer_step(self) -> float:
        norm = float(self.engine.optimizer_step())
        self.engine.optimizer_zero_grad()
        self.stepped = True
        return norm

    # --- weights --------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        params, _ = self.engine.get_per_tensor_param()
        return {name: tensor.detach() for name, tensor in params}
