"""Admission, refinement and step predictors. Empty until the predictors issue lands."""
