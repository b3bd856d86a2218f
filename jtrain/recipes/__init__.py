"""The models and data of the recipes in `configs/recipes/` (one module per workload),
named there by factory (`model.factory`, `data.source`, `loss.fn`, `eval.predict_fn`):
`imputation` (genomic tracks), `tokensets` (token sets and the set encoder shared by
`pretrain` (masked pretraining and the fine-tune classifier) and `set_completion`),
`classify` (scikit-learn's breast-cancer table), `autoencoder` (multi-modal, weighted
multi-loss), `gan` (a step of your own: a GAN on a 2-D ring), `sam` (a step of your
own: sharpness-aware minimisation on the breast-cancer table), `byol` (a step of your
own: BYOL with an EMA target network, a linear probe as its contract), and `report`
(`python -m jtrain.recipes.report RUN...`, the stated result of finished runs).

Every data set is either generated here, deterministically from a seed by the process
each module's docstring describes, or ships inside an installed package: nothing is
downloaded. The recipes need `pip install 'jtrain[recipes]'`.
"""
