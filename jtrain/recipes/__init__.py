"""The models and data of the recipes in `configs/recipes/` (one module per workload),
named there by factory (`model.factory`, `data.source`, `loss.fn`, `eval.predict_fn`):
`imputation` (genomic tracks), `tokensets` (token sets and the set encoder shared by
`pretrain` (masked pretraining and the fine-tune classifier) and `set_completion`),
`classify` (scikit-learn's breast-cancer table), `autoencoder` (multi-modal, weighted
multi-loss), steps of your own: `gan` (a GAN on a 2-D ring), `distill` (the reference
transformer distilled), `dpo` (preference tuning of the transformer against a frozen
reference), `sam` (sharpness-aware minimisation on the breast-cancer table),
`byol` (BYOL with an EMA target network, a linear probe as its contract); and `report`
(`python -m jtrain.recipes.report RUN...`, the stated result of finished runs).

Every data set is either generated here, deterministically from a seed by the process
each module's docstring describes, read from a file the config names (dpo's
pairs), or ships inside an installed package: nothing is
downloaded. The recipes need `pip install 'jtrain[recipes]'`.
"""
