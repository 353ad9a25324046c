"""The learner: FSDP2 ranks training the actor (and critic) on batches from the buffer.

Modules, from the outside in: ``worker`` (``LearnerWorker``: one rank's API for the runtime),
``actor`` (``Actor``, ``ReferencePolicy``), ``critic`` (``Critic``), ``update_loop`` (epochs x
mini-batches x micro-batches, exact loss scaling, bad-step skipping), ``batching`` (which rows
each rank processes in which micro-batch), ``forward`` (one packed or padded forward),
``fsdp`` (process group, mesh, sharding, full-parameter gather), ``optim`` (AdamW + schedule),
``checkpoint`` (atomic DCP checkpoints, HF export). Nothing is imported here, so importing
``streamrl.learner.checkpoint`` stays cheap.
"""
