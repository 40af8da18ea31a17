"""Floor 1: pipeline schedules as data, in torch.distributed.pipelining's notation.

:mod:`.ir` holds the IR (``Action``, ``Schedule``, validation, string and torch round
trips, the dependency ``walk``); :mod:`.registry` the one table of kinds;
:mod:`.generators` the modern schedules' generators and placements; :mod:`.build` a
call's schedule. Nothing here imports the rest of ipukit.
"""
from .generators import (LOOPED, SPLIT_BACKWARD, V_SHAPED, Op, check_placement, dualpipev,
                         interleaved_1f1b, lanes_for, looped_bfs, minimum_micro_batches,
                         placement, zb_h1, zbv)
from .build import build, stage_program
from .ir import (ACTION_KINDS, BACKWARD, FORWARD, INPUT_GRAD, STEP, WEIGHT_GRAD, Action,
                 Schedule, ScheduleError, walk)
from .registry import KINDS, KINDS_BY_NAME, PIPELINED_KINDS, SCHEDULE_TITLES, Kind, kind_of

__all__ = ["ACTION_KINDS", "BACKWARD", "KINDS_BY_NAME", "Kind", "SCHEDULE_TITLES", "FORWARD", "INPUT_GRAD", "KINDS", "LOOPED",
           "PIPELINED_KINDS", "SPLIT_BACKWARD", "STEP", "V_SHAPED", "WEIGHT_GRAD", "Action", "Op",
           "Schedule", "ScheduleError", "build", "check_placement", "dualpipev",
           "interleaved_1f1b", "kind_of", "lanes_for", "looped_bfs", "minimum_micro_batches",
           "placement", "stage_program", "walk", "zb_h1", "zbv"]
