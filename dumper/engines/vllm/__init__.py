"""vLLM, run as users run it: the engine adapter (:mod:`~dumper.engines.vllm.engine`: ``load_llm``, ``dump_llm``),
the tap its model loader installs in every process it starts (:mod:`~dumper.engines.vllm.tap`, the
``vllm.general_plugins`` entry point), the model hooks (:mod:`~dumper.engines.vllm.hooks`), each rank's spool
(:mod:`~dumper.engines.vllm.spool`) and the join of the ranks' parts (:mod:`~dumper.engines.vllm.parts`), and
capture from a live ``vllm serve`` (:mod:`~dumper.engines.vllm.serve`).
"""
