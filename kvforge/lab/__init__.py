"""`kvforge lab`: measure every KV technique on the user's model and text; write results.json and a report."""
from kvforge.lab.options import LabOptions
from kvforge.lab.runner import LabRun, run_lab

__all__ = ["LabOptions", "LabRun", "run_lab"]
