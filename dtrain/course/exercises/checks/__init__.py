"""The exercises' checks, one module per subject. Each check is ``check(fn, comm, grade)``, run on every rank (see
:mod:`dtrain.course.exercises.grading`); tests/test_exercises.py runs every one on dtrain's reference."""
