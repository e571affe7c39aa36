//! The answers to Flight SQL's metadata commands, read from a session's catalog: catalogs, schemas,
//! tables (with their Arrow schemas), table types, `SqlInfo` and `XdbcTypeInfo`.
//!
//! Invariant: what a session lists is what its SQL can name (its own DDL included), because every
//! answer is read from that session's `SessionContext` at the time of the call.

use arrow::array::RecordBatch;
use arrow_flight::sql::metadata::{SqlInfoData, SqlInfoDataBuilder, XdbcTypeInfo};
use arrow_flight::sql::metadata::{XdbcTypeInfoData, XdbcTypeInfoDataBuilder};
use arrow_flight::sql::{
    CommandGetCatalogs, CommandGetDbSchemas, CommandGetTableTypes, CommandGetTables, Nullable,
    Searchable, SqlInfo, XdbcDataType,
};
use datafusion::datasource::TableType;
use datafusion::prelude::SessionContext;
use tonic::Status;

/// Names of the table types a session can hold, as Flight SQL lists them.
pub const TABLE_TYPES: [&str; 3] = ["TABLE", "VIEW", "LOCAL TEMPORARY"];

fn table_type_name(table_type: TableType) -> &'static str {
    match table_type {
        TableType::Base => TABLE_TYPES[0],
        TableType::View => TABLE_TYPES[1],
        TableType::Temporary => TABLE_TYPES[2],
    }
}

fn internal(what: &str, error: impl std::fmt::Display) -> Status {
    Status::internal(format!("{what}: {error}"))
}

/// `CommandGetCatalogs`: the session's catalogs.
pub fn catalogs(ctx: &SessionContext, query: CommandGetCatalogs) -> Result<RecordBatch, Status> {
    let mut builder = query.into_builder();
    for name in ctx.catalog_names() {
        builder.append(name);
    }
    builder.build().map_err(|e| internal("listing catalogs", e))
}

/// `CommandGetDbSchemas`: the session's schemas (the builder applies the request's filters).
pub fn schemas(ctx: &SessionContext, query: CommandGetDbSchemas) -> Result<RecordBatch, Status> {
    let mut builder = query.into_builder();
    for catalog_name in ctx.catalog_names() {
        let Some(catalog) = ctx.catalog(&catalog_name) else {
            continue;
        };
        for schema_name in catalog.schema_names() {
            builder.append(&catalog_name, schema_name);
        }
    }
    builder.build().map_err(|e| internal("listing schemas", e))
}

/// `CommandGetTables`: the session's tables and views, with their schemas when asked for.
pub async fn tables(ctx: &SessionContext, query: CommandGetTables) -> Result<RecordBatch, Status> {
    let mut builder = query.into_builder();
    for catalog_name in ctx.catalog_names() {
        let Some(catalog) = ctx.catalog(&catalog_name) else {
            continue;
        };
        for schema_name in catalog.schema_names() {
            let Some(schema) = catalog.schema(&schema_name) else {
                continue;
            };
            let mut names = schema.table_names();
            names.sort();
            for table_name in names {
                let provider = schema
                    .table(&table_name)
                    .await
                    .map_err(|e| internal(&format!("reading table '{table_name}'"), e))?;
                let Some(provider) = provider else {
                    continue;
                };
                builder
                    .append(
                        &catalog_name,
                        &schema_name,
                        &table_name,
                        table_type_name(provider.table_type()),
                        provider.schema().as_ref(),
                    )
                    .map_err(|e| internal(&format!("listing table '{table_name}'"), e))?;
            }
        }
    }
    builder.build().map_err(|e| internal("listing tables", e))
}

/// `CommandGetTableTypes`.
pub fn table_types(query: CommandGetTableTypes) -> Result<RecordBatch, Status> {
    let mut builder = query.into_builder();
    for name in TABLE_TYPES {
        builder.append(name);
    }
    builder
        .build()
        .map_err(|e| internal("listing table types", e))
}

/// What the server says about itself (`CommandGetSqlInfo`).
pub fn sql_info() -> Result<SqlInfoData, Status> {
    let mut builder = SqlInfoDataBuilder::new();
    builder.append(SqlInfo::FlightSqlServerName, "Sluice");
    builder.append(SqlInfo::FlightSqlServerVersion, env!("CARGO_PKG_VERSION"));
    builder.append(SqlInfo::FlightSqlServerArrowVersion, "1.5");
    builder.append(SqlInfo::FlightSqlServerReadOnly, false);
    builder.append(SqlInfo::FlightSqlServerSql, true);
    builder.append(SqlInfo::FlightSqlServerSubstrait, false);
    builder.append(SqlInfo::FlightSqlServerTransaction, 0i32);
    builder.append(SqlInfo::FlightSqlServerCancel, false);
    builder.append(SqlInfo::SqlIdentifierQuoteChar, "\"");
    builder.append(SqlInfo::SqlDdlCatalog, false);
    builder.append(SqlInfo::SqlDdlSchema, true);
    builder.append(SqlInfo::SqlDdlTable, true);
    builder.build().map_err(|e| internal("building SqlInfo", e))
}

/// The SQL types the server offers (`CommandGetXdbcTypeInfo`).
pub fn xdbc_type_info() -> Result<XdbcTypeInfoData, Status> {
    let mut builder = XdbcTypeInfoDataBuilder::new();
    let types = [
        ("BOOLEAN", XdbcDataType::XdbcBit, None),
        ("INT", XdbcDataType::XdbcInteger, Some(32)),
        ("BIGINT", XdbcDataType::XdbcBigint, Some(64)),
        ("DOUBLE", XdbcDataType::XdbcDouble, Some(53)),
        ("DECIMAL", XdbcDataType::XdbcDecimal, Some(38)),
        ("VARCHAR", XdbcDataType::XdbcVarchar, None),
        ("DATE", XdbcDataType::XdbcDate, None),
        ("TIMESTAMP", XdbcDataType::XdbcTimestamp, None),
    ];
    for (name, data_type, column_size) in types {
        builder.append(XdbcTypeInfo {
            type_name: name.into(),
            data_type,
            column_size,
            literal_prefix: matches!(data_type, XdbcDataType::XdbcVarchar).then(|| "'".into()),
            literal_suffix: matches!(data_type, XdbcDataType::XdbcVarchar).then(|| "'".into()),
            create_params: None,
            nullable: Nullable::NullabilityNullable,
            case_sensitive: matches!(data_type, XdbcDataType::XdbcVarchar),
            searchable: Searchable::Full,
            unsigned_attribute: Some(false),
            fixed_prec_scale: matches!(data_type, XdbcDataType::XdbcDecimal),
            auto_increment: Some(false),
            local_type_name: Some(name.into()),
            minimum_scale: None,
            maximum_scale: None,
            sql_data_type: data_type,
            datetime_subcode: None,
            num_prec_radix: None,
            interval_precision: None,
        });
    }
    builder
        .build()
        .map_err(|e| internal("building XdbcTypeInfo", e))
}
