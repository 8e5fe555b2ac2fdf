"""``turbospec simulate``: a discrete-event simulator of a turbospec deployment.

It replays the engine's own policies (the token-budget scheduler's continuous batching and chunked prefill,
fixed-k speculation or the goodput controller's ``choose_lengths``) against time that comes from a step-time
model (a profile measured by ``turbospec profile``, or a stated roofline), with acceptance drawn from recorded
verification traces. Nothing runs a model, so a deployment that does not exist yet (more replicas, another
accelerator, other traffic) can be projected in seconds.

One file per job: ``workload`` (requests: arrivals and lengths), ``draft_outcomes`` (how many drafts a
step offers and keeps), ``step_cost`` (step-time models: profiles and rooflines), ``batching`` (one replica's
scheduler), ``replica`` (one engine: steps, speculation, per-request times), ``router`` (which replica gets a
request), ``metrics`` (latency statistics), ``simulator`` (the event loop) and ``command`` (the CLI).
"""
