"""What is measured on this machine and cached: forward costs t(n) (costs.py, drawn by cost_plots.py), the runtime
model, the draft variants (draft_levers.py, draft_choice.py), and the texts they are measured on (corpus.py,
reference_texts.py)."""
