//! Golden requests' rules that are not about files: how an answer is judged against the values a
//! golden case (or the other version of a rollout) expects. Loading golden files stays in Python.

pub mod compare;
