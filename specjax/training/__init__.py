"""Training drafters on the target's own outputs.

    corpus.py       the self-distillation corpus (the target's chat responses, in shards)
    prompt_pool.py  the evaluation-free prompts the corpus is generated from
    trainer.py      one optax / orbax training loop every drafter kind plugs a loss and params into
    features.py     the frozen target's features over whole windows (what heads train on)
    draft.py        distilling a small same-tokenizer draft model (hard labels from the corpus,
                    optional soft labels from the target's top-k), and the teacher features
    medusa.py       Medusa-1 heads: the loss on a frozen target (`make_loss`)
    eagle.py        EAGLE heads: the loss (smooth-L1 on the next feature, soft CE, unrolling)
    mtp.py          MTP modules: the loss (CE per depth)
    heads.py        `train_heads`: any kinds of heads at once, composing the kinds' losses

Nothing outside training imports it except the CLI; shipped drafters are loaded through
specjax.shipped, which needs no training code.
"""

from specjax.training.trainer import TrainConfig, TrainResult, batch_rows, train  # noqa: F401
