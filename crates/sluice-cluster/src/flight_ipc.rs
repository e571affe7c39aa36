//! Arrow IPC encoding of a task stream for Flight `DoGet`, written against arrow-ipc directly.
//!
//! arrow-flight 59's `FlightDataEncoder` rewrites the schema it sends ("prepares" it for Flight):
//! it turns a `LargeList` field into a `List` while the arrays keep 64-bit offsets, so a reader gets
//! another type, or wrong values (a `LargeList` literal arrives empty), and by default it hydrates
//! dictionaries. A task stream must arrive exactly as it was written, so this encoder sends the
//! stream's own schema and each batch with its dictionaries, as arrow's IPC stream format does.
//!
//! ```text
//!   schema ─► FlightData(schema message)
//!   batch  ─► FlightData(dictionary batch) …  FlightData(record batch)   (dictionaries resent)
//! ```

use arrow_flight::FlightData;
use datafusion::arrow::array::RecordBatch;
use datafusion::arrow::datatypes::SchemaRef;
use datafusion::arrow::ipc::writer::{
    DictionaryTracker, IpcDataGenerator, IpcWriteContext, IpcWriteOptions,
};
use datafusion::common::{DataFusionError, Result};
use futures::{Stream, StreamExt, stream};

/// The Flight messages of a stream of `schema` whose batches come from `batches`.
pub fn encode_stream<S>(
    schema: SchemaRef,
    batches: S,
    options: IpcWriteOptions,
) -> impl Stream<Item = Result<FlightData>> + Send + 'static
where
    S: Stream<Item = Result<RecordBatch>> + Send + 'static,
{
    let mut encoder = Encoder {
        options,
        generator: IpcDataGenerator::default(),
        // A dictionary may change from batch to batch: resend it, never fail on replacement.
        dictionaries: DictionaryTracker::new(false),
        context: IpcWriteContext::default(),
    };
    // Each batch's body starts in a buffer of the last one's size instead of growing into it
    // (measured in `benches/flight.rs`: the regrowth cost as much as the copy itself).
    encoder.context.set_reserve_scratch(true);
    // The schema message assigns the dictionary ids the batches' dictionary messages refer to.
    let header = FlightData::from(encoder.generator.schema_to_bytes_with_dictionary_tracker(
        &schema,
        &mut encoder.dictionaries,
        &encoder.options,
    ));
    let body = batches.flat_map(move |batch| {
        let messages = batch.and_then(|batch| encoder.encode(&batch));
        stream::iter(match messages {
            Ok(messages) => messages.into_iter().map(Ok).collect::<Vec<_>>(),
            Err(error) => vec![Err(error)],
        })
    });
    stream::once(async move { Ok(header) }).chain(body)
}

struct Encoder {
    options: IpcWriteOptions,
    generator: IpcDataGenerator,
    dictionaries: DictionaryTracker,
    context: IpcWriteContext,
}

impl Encoder {
    /// The dictionary messages `batch` needs, then the batch itself.
    fn encode(&mut self, batch: &RecordBatch) -> Result<Vec<FlightData>> {
        let (dictionaries, batch) = self
            .generator
            .encode(
                batch,
                &mut self.dictionaries,
                &self.options,
                &mut self.context,
            )
            .map_err(|e| DataFusionError::ArrowError(Box::new(e), None))?;
        Ok(dictionaries
            .into_iter()
            .map(FlightData::from)
            .chain(std::iter::once(FlightData::from(batch)))
            .collect())
    }
}
