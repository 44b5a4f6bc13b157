"""The predictors of remaining work: admission (``admission``: total rounds from the prompt), refinement
(``refine``: after the first denoising round) and step (``step``: remaining steps after each step), their
features (``features``), collection, training and the shipped bundle (``collect``, ``pipeline``,
``bundle``, ``cli``), and the online learners that train them on served traffic (``online``) with their
refit worker process (``refit_worker``)."""
