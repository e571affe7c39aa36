//! Sluice's own plan nodes that the planner places into stage plans.

pub mod rescale;
pub mod stage_input;
