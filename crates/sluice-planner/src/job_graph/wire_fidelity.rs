//! Whether a stage plan survives the wire exactly. A stage that would not runs on the driver, from
//! its in-memory plan, rather than compute something else on a worker: that is always correct, only
//! slower. Two checks decide it:
//! - what the planner itself knows of datafusion-proto 55's gaps, which no decoded plan shows: a
//!   `Float16` literal is encoded as `Float32`; a file scan's compression and its `preserve_order`
//!   flag are not encoded at all (a gzip CSV would be read as plain text). The decoder rebuilds
//!   `preserve_order` from the scan's output ordering, which is encoded, so only a scan that must
//!   keep its files' order without declaring one (an order-sensitive limit) is held back;
//! - the runtime's [`WireCheck`](super::WireCheck), when the job graph is built with one: the plan is
//!   encoded and decoded and must come back the same (a node without a wire form, or one whose
//!   options the encoding drops, fails it).
//!
//! This is the only place the decision is made: `Stage::placement` carries it to EXPLAIN, the
//! scheduler and task placement.

use std::sync::Arc;

use datafusion::common::Result;
use datafusion::common::ScalarValue;
use datafusion::common::tree_node::{TreeNode, TreeNodeRecursion};
use datafusion::datasource::physical_plan::FileScanConfig;
use datafusion::datasource::source::DataSourceExec;
use datafusion::physical_expr::expressions::Literal;
use datafusion::physical_plan::ExecutionPlan;

/// What the checks found of a stage plan.
pub(crate) enum Travel {
    /// It reaches a worker exactly as it is; its encoded form, if the wire check made one.
    Exact(Option<bytes::Bytes>),
    /// It would not: it runs on the driver.
    Changed,
}

/// Whether `plan` reaches a worker exactly as it is.
pub(crate) fn travel(
    plan: &Arc<dyn ExecutionPlan>,
    options: &super::JobGraphOptions,
) -> Result<Travel> {
    if has_lossy_literal(plan)? || has_unencoded_scan_option(plan)? {
        return Ok(Travel::Changed);
    }
    Ok(match &options.wire_check {
        None => Travel::Exact(None),
        Some(check) => check(plan).map_or(Travel::Changed, |bytes| Travel::Exact(Some(bytes))),
    })
}

/// Whether `plan` holds a literal that datafusion-proto 55 does not encode exactly.
fn has_lossy_literal(plan: &Arc<dyn ExecutionPlan>) -> Result<bool> {
    let mut lossy = false;
    plan.apply(|node| {
        node.apply_expressions(&mut |expr| {
            expr.apply(|e| {
                if let Some(literal) = e.downcast_ref::<Literal>()
                    && matches!(literal.value(), ScalarValue::Float16(_))
                {
                    lossy = true;
                    return Ok(TreeNodeRecursion::Stop);
                }
                Ok(TreeNodeRecursion::Continue)
            })
        })?;
        Ok(if lossy {
            TreeNodeRecursion::Stop
        } else {
            TreeNodeRecursion::Continue
        })
    })?;
    Ok(lossy)
}

/// Whether `plan` scans files with an option datafusion-proto 55 does not encode: a compression, or
/// an order the files must be read in that no output ordering declares (decoding a scan with an
/// output ordering sets `preserve_order` again: a sorted Parquet file's scan travels exactly).
fn has_unencoded_scan_option(plan: &Arc<dyn ExecutionPlan>) -> Result<bool> {
    let mut found = false;
    plan.apply(|node| {
        if let Some(scan) = node.downcast_ref::<DataSourceExec>()
            && let Some(files) = scan.data_source().downcast_ref::<FileScanConfig>()
            && (files.file_compression_type.is_compressed()
                || (files.preserve_order && files.output_ordering.is_empty()))
        {
            found = true;
            return Ok(TreeNodeRecursion::Stop);
        }
        Ok(TreeNodeRecursion::Continue)
    })?;
    Ok(found)
}
