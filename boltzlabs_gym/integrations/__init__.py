"""Rewards and environments for LLM reinforcement-learning frameworks, on top of the pool.

One module per framework, each importing its framework only there (install its extra):

* :mod:`~boltzlabs_gym.integrations.trl`: TRL's ``GRPOTrainer`` (``reward_funcs=``, ``environment_factory=``);
  ``pip install 'boltzlabs-gym[trl]'``.
* :mod:`~boltzlabs_gym.integrations.verl`: verl's ``compute_score`` and a ``BaseTool``; ``[verl]``.
* :mod:`~boltzlabs_gym.integrations.skyrl`: a ``skyrl_gym`` ``BaseTextEnv``; ``[skyrl]``.

and the framework-free parts they share:

* :mod:`~boltzlabs_gym.integrations.grading`: :class:`~boltzlabs_gym.integrations.grading.Grader`, which
  grades a batch of completions against their test cases on one
  :class:`~boltzlabs_gym.code.CodeRunner` (one queue, every program in a fresh sandbox, killed
  with its process tree on its deadline) and never raises for bad input, and its plain async callable;
* :mod:`~boltzlabs_gym.integrations.leases`: one pool env per rollout or trajectory, leased and given back;
* :mod:`~boltzlabs_gym.integrations.groups`: GRPO groups prepared once and forked into G copies.

Nothing here is imported by the env side or the worker.
"""
