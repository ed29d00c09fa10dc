"""`kvforge advise`: a selection tree from workload, device and model to an engine configuration,
and `--measure`, which ranks candidate configurations by what the engine measures on the model."""
from kvforge.advise.inputs import DEFAULT_MAX_LOSS, PRIORITIES, AdviseInputs, parse_context
from kvforge.advise.measure import Candidate, Measurement, Row, measure, parse_candidate, parse_candidates, rank
from kvforge.advise.recommend import MemoryConsequence, MemoryLine, Recommendation
from kvforge.advise.tree import PRIOR_LOSS, Advice, Step, advise

__all__ = ["DEFAULT_MAX_LOSS", "PRIORITIES", "PRIOR_LOSS", "Advice", "AdviseInputs", "Candidate", "Measurement",
           "MemoryConsequence", "MemoryLine", "Recommendation", "Row", "Step", "advise", "measure", "parse_candidate",
           "parse_candidates", "parse_context", "rank"]
