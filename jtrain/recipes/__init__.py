"""The models and data of the recipes in `configs/recipes/` (one module per workload),
named there by factory (`model.factory`, `data.source`, `loss.fn`, `eval.predict_fn`).

Every data set is either generated here, deterministically from a seed by the process
each module's docstring describes, or ships inside an installed package (scikit-learn's
breast-cancer table): nothing is downloaded. `python -m jtrain.recipes.report RUN...`
prints the stated result of finished runs.
"""
