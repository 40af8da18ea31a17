"""PopTorch's enumerations, with PopTorch's names and values."""
import enum


class OutputMode(enum.IntEnum):
    """What a model call returns of the outputs of its micro-batches.

    - ``Final``: only the last micro-batch's outputs.
    - ``EveryN``: the outputs of every N-th micro-batch (N is the
      ``output_return_period`` of :meth:`Options.outputMode`).
    - ``All``: the outputs of every micro-batch, concatenated on the batch dimension.
    - ``Sum``: the element-wise sum of every micro-batch's outputs.
    - ``Default``: ``Final`` for a training model, ``All`` for an inference model.
    """

    Final = 0
    EveryN = 1
    All = 2
    Sum = 3
    Default = 4


class ReductionType(enum.IntEnum):
    """How gradients of micro-batches and replicas are combined before a step."""

    Sum = 0
    Mean = 1
    NoReduction = 2


class MeanReductionStrategy(enum.IntEnum):
    """Accepted for compatibility; ipukit always divides after accumulating (``Post``)."""

    Running = 0
    Post = 1
    PostAndLoss = 2


class DataLoaderMode(enum.IntEnum):
    """``Sync`` loads on the caller's thread; ``Async`` loads ahead in the background."""

    Sync = 0
    Async = 1
    AsyncRebatched = 2


class AutoStage(enum.IntEnum):
    """How blocks without an explicit :class:`Stage` get their stage id.

    - ``SameAsIpu``: the stage id is the block's ``ipu_id``.
    - ``AutoIncrement``: every new block gets the next stage id.
    """

    SameAsIpu = 0
    AutoIncrement = 1


class ConnectionType(enum.IntEnum):
    """Accepted for compatibility; virtual IPUs are always available."""

    Always = 0
    OnDemand = 1
    Never = 2


class SyncPattern(enum.IntEnum):
    """Accepted for compatibility; no effect in ipukit."""

    Full = 0
    SinglePipeline = 1
    ReplicaAndLadder = 2


class HalfFloatCastingBehavior(enum.IntEnum):
    """Accepted for compatibility; no effect in ipukit."""

    FloatDowncastToHalf = 0
    HalfUpcastToFloat = 1
    Default = 2


# PopTorch 2.0–2.3's name (``Options.anchorMode(AnchorMode.All)``)
AnchorMode = OutputMode


class SharingStrategy(enum.IntEnum):
    """Accepted for compatibility: how PopTorch's DataLoader shared data with workers."""

    SharedMemory = 0
    FileSystem = 1
    Fork = 2
    ForkServer = 3


class MatMulSerializationMode(enum.Enum):
    """Which dimension :func:`~ipukit.serializedMatMul` splits on (IPU memory only)."""

    InputChannels = "input_channels"
    ReducingDim = "reducing_dim"
    OutputChannels = "output_channels"
    Disabled = "none"


class Liveness(enum.IntEnum):
    """Accepted for compatibility: tensor liveness under phased execution."""

    AlwaysLive = 0
    OffChipAfterFwd = 1
    OffChipAfterFwdNoOverlap = 2
    OffChipAfterEachPhase = 3


class OverlapMode(enum.Enum):
    """How host transfers overlap compute (:func:`~ipukit.set_overlap_for_input`); no effect."""

    NoOverlap = "no_overlap"
    OverlapAccumulationLoop = "overlap_accumulation_loop"
    OverlapDeviceIterationLoop = "overlap_device_iteration_loop"


class MultiConvPlanType(enum.IntEnum):
    """How a :class:`~ipukit.MultiConv` plans its convolutions; no effect."""

    Parallel = 0
    Serial = 1


class CommGroupType(enum.IntEnum):
    """Accepted for compatibility: replica grouping of variables and inputs."""

    All = 0
    Consecutive = 1
    Orthogonal = 2
    NoGrouping = 3


class VariableRetrievalMode(enum.IntEnum):
    """Accepted for compatibility: how grouped replica variables are read back."""

    OnePerGroup = 0
    AllReplicas = 2
