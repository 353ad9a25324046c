"""Bucketed broadcast of weights on a dedicated process group (gloo on CPU, NCCL on GPU).

Modules (``publisher`` and ``receiver`` import ``wire`` and ``weight_bus.base``, never each other;
nothing here is imported by ``base``):
- ``wire``: ``send_planned`` / ``send_streamed`` / ``recv_version``, the data-plane format of one
  version on a formed group (a version header; then either the segments of the model's
  ``buckets.BucketPlan``, the plan itself sent once per generation, with no per-bucket header,
  or, for the first version of a model, each bucket after its header and msgpack
  ``BucketSpec``), and ``manifest_of``.
- ``publisher``: ``CollectivePublisher`` (learner rank 0): roster and acks over
  ``control.ControlServer``, group generations over one ``TCPStore``; ``publish`` packs lazily
  from the iterator (the first version makes the bucket plan, later ones follow it), broadcasts,
  checks every receiver's ``received`` ack (with the manifest it assembled) within timeout_s.
- ``receiver``: ``CollectiveReceiver`` + ``LocalLanding``: a background thread that joins each
  announced generation, receives the version in this process and hands it whole to the sink.
  ``vllm_receiver.VLLMWorkerLanding`` lands buckets inside a vLLM worker instead.

Failure handling. Every wait is bounded by ``timeout_s`` and polls a check: on the learner, "has
a member stopped heartbeating or acked ``failed``"; on receivers, "did the learner set this
generation's abort flag". When a receiver dies mid-broadcast the learner still drains the
iterator (FSDP ranks gather in lockstep), aborts the generation, names the dead receivers
(``ReceiverDied``), forms a new generation with the survivors and re-sends the version to them
from its copy, so survivors rejoin without any action of theirs.

Late joiners (documented choice): with ``keep_latest`` (default on gloo/CPU) the learner keeps the
latest version (one extra copy of the weights in host memory) and a background thread sends it
to any receiver that joins late, on a generation of its own, right away. Weights that come
``HandedOver`` (the learner's, when gathered from shards or cast) are kept by reference: they go
out zero-copy and only runs of small weights are copied. Any other iterable may be written to
after ``publish``: it is packed into the kept copy, which is the one copy such a version costs
(the segments go out from it). Without it (default with NCCL: the copy would cost GPU memory;
weights go out zero-copy where they lie contiguously) a late joiner gets the weights with the
next ``publish``.
"""

from streamrl.weight_bus.collective.publisher import CollectivePublisher
from streamrl.weight_bus.collective.receiver import (
    CollectiveReceiver,
    Landing,
    LocalLanding,
    default_receiver_id,
)
from streamrl.weight_bus.collective.wire import (
    manifest_of,
    recv_version,
    send_planned,
    send_streamed,
)

__all__ = [
    "CollectivePublisher",
    "CollectiveReceiver",
    "Landing",
    "LocalLanding",
    "default_receiver_id",
    "manifest_of",
    "recv_version",
    "send_planned",
    "send_streamed",
]
