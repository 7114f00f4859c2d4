"""Pipeline parallelism with torch.distributed.pipelining's API over pynccl's grouped p2p.

    stage = PipelineStage(build_stage_module(layers, pp_rank, pp_size), pp_rank, pp_size, group=pp_group)
    schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=nn.functional.mse_loss)
    out = schedule.step(x)                         # first stage
    out = schedule.step(target=y, losses=losses)   # last stage: merged output, per-micro-batch losses
    optimizer.step()                               # each rank steps its own stage

Layout: actions (schedules as data), schedule_checker (simulate them: deadlocks, bubble),
p2p (transport), stage, schedules (executor), split (layers -> stages), hf (stages of a Hugging Face
causal LM: hf_stage_modules(model, pp_rank, pp_size), loss_fn=causal_lm_loss), state_dict (a stage's state
dicts under the whole model's names: to_model_keys / to_stage_keys, for checkpoints across layouts).
"""
from .hf import causal_lm_loss, hf_layer_ranges, hf_stage_module, hf_stage_modules
from .actions import Action, ActionType, PipelineLayout, ScheduleKind, build_programs, format_program
from .schedule_checker import ScheduleError, SimResult, check, expected_bubble, simulate
from .schedules import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from .split import build_stage_module, split_into_stages
from .state_dict import model_names, to_model_keys, to_stage_keys
from .stage import PipelineStage

__all__ = ["PipelineStage", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "split_into_stages",
           "build_stage_module", "Action", "ActionType", "PipelineLayout", "ScheduleKind", "build_programs",
           "format_program", "check", "simulate", "expected_bubble", "ScheduleError", "SimResult",
           "hf_stage_module", "hf_stage_modules", "hf_layer_ranges", "causal_lm_loss", "model_names", "to_model_keys",
           "to_stage_keys"]
