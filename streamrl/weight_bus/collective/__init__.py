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
  announced generation, receives the version in this process and hands it whole to the sink
  (``receive="staged"``), or hands the sink the version first and the sink's load receives it
  bucket by bucket into one buffer (``receive="streamed"``, ``weight_bus.receive``).
  ``vllm_receiver.VLLMWorkerLanding`` lands buckets inside a vLLM worker instead.

Failure handling. Every wait is bounded by ``timeout_s`` and polls a check: on the learner, "has
a member stopped heartbeating or acked ``failed``"; on receivers, "did the learner set this
generation's abort flag". When a receiver dies mid-broadcast the learner still drains the
iterator (FSDP ranks gather in lockstep), aborts the generation and names the dead receivers
(``ReceiverDied``); the survivors did not get that version either.

Memory (documented choice): the publisher keeps no copy of any version. It stages one bucket at
a time for the first version of a model and, for later ones, only runs of small weights, in
buffers of one chunk reused from segment to segment; large weights go out as views of the
learner's own tensors, held while on the wire (at most about one bucket of them). So a receiver
that has not received the latest version (``CollectivePublisher.behind``: created or restarted
after it was published, or a survivor of its failed broadcast) is not served from a copy: it gets
the next ``publish``, or the learner gathers the same weights again at a step boundary and
``catch_up`` re-sends that version to those receivers only (the runtime does so while the
learner waits for groups, so a fleet that is behind as a whole cannot stall it). A receiver
holds a whole version (``staged``: buffers of the plan's bucket sizes, kept from version to
version, so its engine samples through the transfer) or one bucket (``streamed``: a buffer of the
plan's largest bucket, which a weight larger than ``bucket_mb`` sets, while its engine is
paused for the transfer and the load).
"""

from streamrl.weight_bus.collective.publisher import CollectivePublisher
from streamrl.weight_bus.collective.receiver import (
    RECEIVE_MODES,
    CollectiveReceiver,
    Incoming,
    Landing,
    LocalLanding,
    Streamed,
    default_receiver_id,
)
from streamrl.weight_bus.collective.wire import (
    manifest_of,
    recv_buckets,
    recv_version,
    send_planned,
    send_streamed,
)

__all__ = [
    "RECEIVE_MODES",
    "CollectivePublisher",
    "CollectiveReceiver",
    "Incoming",
    "Landing",
    "LocalLanding",
    "Streamed",
    "default_receiver_id",
    "manifest_of",
    "recv_buckets",
    "recv_version",
    "send_planned",
    "send_streamed",
]
