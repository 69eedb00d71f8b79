"""The flush-free pipeline: 2BW's pieces, each small and pure where it can be, and the engine that runs them.

- :mod:`.version_rule`: which weight version each micro-batch runs on, one rule per schedule, in a registry.
- :mod:`.schedule`: the per-stage instruction stream of flush-free 1F1B (a generator, as DeepSpeed's schedules).
- :mod:`.simulate`: a dry run of that schedule over all stages, with no processes (deadlock, versions, bubble).
- :mod:`.versions`: one stage's weight store (the versions a forward may read, where gradients land).
- :mod:`.steps`: how a stage's optimizer takes the pipeline's gradient norm and steps, per kind of optimizer.
- :mod:`.streams`: the CUDA streams that overlap a stage's batch boundary and step with its passes (CPU: no-ops).
- :mod:`.graphs`: a stage's forward and backward replayed as CUDA graphs, per weight slot and micro-batch in flight.
- :mod:`.bf16`: DeepSpeed's bf16 optimizer under a flush-free schedule.
- :mod:`.engine`: ``AsyncPipelineEngine``, DeepSpeed's ``PipelineEngine`` running all of the above.
"""
