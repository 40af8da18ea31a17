"""The kinds of work a timeline records, and which of them count as what (busy time, idle
time, held activations); the executor, simulator and process runtime name their events with
:data:`KIND_NAMES`.
"""

KIND_NAMES = {"F": "forward", "B": "backward", "I": "input-grad", "W": "weight-grad", "S": "step"}
#: Work that makes a virtual IPU busy. The optimiser step is not among them: ipukit runs it
#: once, on the host, for every stage's weights (the executor and the model both record one
#: ``step`` event per stage with the same span), so during a step every virtual IPU waits.
COMPUTE_KINDS = ("forward", "backward", "input-grad", "weight-grad")
#: The kinds that end a micro-batch's backward pass on a stage (a full backward, or the
#: weight-gradient half of a split one: the activations are held until then).
BACKWARD_END_KINDS = ("backward", "weight-grad")
#: Work on the host while the virtual IPUs wait for it.
HOST_KINDS = ("host", "transfer")
