"""Pure tensor math of post-training: advantage estimators, policy losses, KL estimators,
preference losses, distillation losses, loss aggregation and sampling filters.

Every algorithm is a function with explicit hyperparameters, registered by name; losses return
(loss, metrics) with metrics as 0-dim tensors (the logger calls .item() once per step). This
package imports nothing from the project except `posttrain.ops`. See docs/algorithms.md.

The registries are `advantages`, `policy_losses`, `preference_losses`, `kl_estimators`,
`distill_losses`; the functions live in adv_estimators.py, pg_losses.py, preference.py, kl.py,
distill.py (module names differ from the registry names so neither shadows the other).

    from posttrain.algos import advantages, policy_losses, aggregate
    adv, m1 = advantages.get("grpo")(rewards, group_ids, std_scale="group")
    loss_tok, m2 = policy_losses.get("clip_higher")(logp, old_logp, adv, mask)
    loss = aggregate(loss_tok, mask, "token_mean", norm_tokens=global_tokens)
"""

from posttrain.algos import adv_estimators as _adv_module  # noqa: F401
from posttrain.algos import distill as _distill_module  # noqa: F401
from posttrain.algos import kl as _kl_module  # noqa: F401
from posttrain.algos import pg_losses as _pl_module  # noqa: F401
from posttrain.algos import preference as _pref_module  # noqa: F401
from posttrain.algos.adv_estimators import gae  # noqa: F401
from posttrain.algos.aggregate import MODES as AGGREGATION_MODES  # noqa: F401
from posttrain.algos.aggregate import aggregate, loss_token_count, sequence_count  # noqa: F401
from posttrain.algos.filters import FilterResult, dynamic_sampling, in_band, learnability_band  # noqa: F401
from posttrain.algos.kl import (  # noqa: F401
    BETA_PRESETS,
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    kl_k1,
    kl_k2,
    kl_k3,
)
from posttrain.algos.pg_losses import value_loss  # noqa: F401
from posttrain.algos.registry import (  # noqa: F401  (the registries; importing the modules above fills them)
    Registry,
    advantages,
    distill_losses,
    kl_estimators,
    policy_losses,
    preference_losses,
)
from posttrain.algos.reward_model import bradley_terry_loss  # noqa: F401
