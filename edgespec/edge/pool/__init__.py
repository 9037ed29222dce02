"""The draft pool (issue 10): experts that propose draft trees, merged into one tree per step.

experts.py (the interface, model and LoRA experts), lookup.py (suffix lookup over the conversation
and a local corpus), templates.py (structured output), merge.py (one tree from many), pool.py
(DraftPool: the Drafter interface, memory budget, LRU, stats for the router).
"""
from edgespec.edge.pool.experts import Expert, ExpertStats, LoraExpert, ModelExpert
from edgespec.edge.pool.lookup import LookupExpert, SuffixIndex
from edgespec.edge.pool.merge import Merged, merge_drafts
from edgespec.edge.pool.pool import GiB, DraftPool, PoolMemoryError, lookup_first_pool
from edgespec.edge.pool.templates import TemplateExpert, tool_rules

__all__ = ["DraftPool", "Expert", "ExpertStats", "GiB", "LoraExpert", "LookupExpert", "Merged", "ModelExpert",
           "PoolMemoryError", "SuffixIndex", "TemplateExpert", "lookup_first_pool", "merge_drafts", "tool_rules"]
