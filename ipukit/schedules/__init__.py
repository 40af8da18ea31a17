"""Floor 1: pipeline schedules as data, in torch.distributed.pipelining's notation.

:mod:`.ir` holds the IR (``Action``, ``Schedule``, validation, string and torch round
trips, ``build`` and the dependency ``walk``); :mod:`.generators` the modern schedules'
generators and placements. Nothing here imports the rest of ipukit.
"""
from .generators import (LOOPED, SPLIT_BACKWARD, V_SHAPED, Op, check_placement, dualpipev,
                         interleaved_1f1b, lanes_for, looped_bfs, minimum_micro_batches,
                         placement, zb_h1, zbv)
from .ir import (ACTION_KINDS, BACKWARD, FORWARD, INPUT_GRAD, KINDS, PIPELINED_KINDS, STEP,
                 WEIGHT_GRAD, Action, Schedule, ScheduleError, build, kind_of, stage_program,
                 walk)

__all__ = ["ACTION_KINDS", "BACKWARD", "FORWARD", "INPUT_GRAD", "KINDS", "LOOPED",
           "PIPELINED_KINDS", "SPLIT_BACKWARD", "STEP", "V_SHAPED", "WEIGHT_GRAD", "Action", "Op",
           "Schedule", "ScheduleError", "build", "check_placement", "dualpipev",
           "interleaved_1f1b", "kind_of", "lanes_for", "looped_bfs", "minimum_micro_batches",
           "placement", "stage_program", "walk", "zb_h1", "zbv"]
