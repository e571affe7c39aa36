//! The 22 TPC-H queries, ready to run.
//!
//! The query texts come from `tpchgen::q_and_a` with their `:n` parameters replaced by the TPC-H
//! validation substitution parameters (spec appendix), so the official scale-factor-1 answers apply. Two
//! more things make them spec-exact: the row limits the spec gives (q2, q3, q10, q18, q21 return the first
//! 100, 10, 20, 100 and 100 rows), and q11's fraction, which is `0.0001 / SF`. q15 is three statements
//! (create view, select, drop view); its stream number `:s` becomes `0`. q1's `interval '90' day (3)`
//! carries a leading-field precision that DataFusion does not parse; it is dropped (it does not change the
//! interval).

use sluice_engine::{Result, SluiceError};

/// TPC-H query numbers.
pub const QUERY_NUMBERS: std::ops::RangeInclusive<u8> = 1..=22;

/// One TPC-H query as the statements to run.
#[derive(Debug, Clone, PartialEq)]
pub struct TpchQuery {
    /// 1 to 22.
    pub number: u8,
    /// The statements, in order.
    pub statements: Vec<String>,
    /// Which statement's output is the query's answer.
    pub result_statement: usize,
}

/// The validation parameters, `:1`, `:2`, … in order.
fn parameters(number: u8, scale_factor: f64) -> Vec<String> {
    let fixed: &[&str] = match number {
        1 => &["90"],
        2 => &["15", "BRASS", "EUROPE"],
        3 => &["BUILDING", "1995-03-15"],
        4 => &["1993-07-01"],
        5 => &["ASIA", "1994-01-01"],
        6 => &["1994-01-01", "0.06", "24"],
        7 => &["FRANCE", "GERMANY"],
        8 => &["BRAZIL", "AMERICA", "ECONOMY ANODIZED STEEL"],
        9 => &["green"],
        10 => &["1993-10-01"],
        11 => return vec!["GERMANY".into(), q11_fraction(scale_factor)],
        12 => &["MAIL", "SHIP", "1994-01-01"],
        13 => &["special", "requests"],
        14 => &["1995-09-01"],
        15 => &["1996-01-01"],
        16 => &[
            "Brand#45",
            "MEDIUM POLISHED",
            "49",
            "14",
            "23",
            "45",
            "19",
            "3",
            "36",
            "9",
        ],
        17 => &["Brand#23", "MED BOX"],
        18 => &["300"],
        19 => &["Brand#12", "Brand#23", "Brand#34", "1", "10", "20"],
        20 => &["forest", "1994-01-01", "CANADA"],
        21 => &["SAUDI ARABIA"],
        22 => &["13", "31", "23", "29", "30", "18", "17"],
        _ => &[],
    };
    fixed.iter().map(|s| s.to_string()).collect()
}

/// q11 keeps parts worth more than `0.0001 / SF` of the total.
fn q11_fraction(scale_factor: f64) -> String {
    let text = format!("{:.12}", 0.0001 / scale_factor);
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// The spec's row limit for queries that return "the first N rows".
fn row_limit(number: u8) -> Option<usize> {
    match number {
        2 | 18 | 21 => Some(100),
        3 => Some(10),
        10 => Some(20),
        _ => None,
    }
}

/// Replaces `:s` and every `:N` with its parameter; an unknown `:N` is an error.
fn substitute(text: &str, parameters: &[String], number: u8) -> Result<String> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(':') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let digits = after.chars().take_while(char::is_ascii_digit).count();
        if digits > 0 {
            let index: usize = after[..digits].parse().unwrap_or(0);
            let value = index
                .checked_sub(1)
                .and_then(|i| parameters.get(i))
                .ok_or_else(|| {
                    SluiceError::invalid(format!("TPC-H q{number}: no parameter :{index}"))
                })?;
            out.push_str(value);
            rest = &after[digits..];
        } else if let Some(stripped) = after.strip_prefix('s') {
            out.push('0');
            rest = stripped;
        } else {
            out.push(':');
            rest = after;
        }
    }
    out.push_str(rest);
    Ok(out)
}

/// TPC-H query `number` at `scale_factor`.
pub fn tpch_query(number: u8, scale_factor: f64) -> Result<TpchQuery> {
    let text = tpchgen::q_and_a::queries::query(i32::from(number)).ok_or_else(|| {
        SluiceError::invalid(format!(
            "unknown TPC-H query {number}: queries are numbered 1 to 22"
        ))
    })?;
    let text =
        substitute(text, &parameters(number, scale_factor), number)?.replace(" day (3)", " day");
    let mut statements: Vec<String> = text
        .split(';')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    let result_statement = statements
        .iter()
        .rposition(|s| s.to_ascii_lowercase().starts_with("select"))
        .ok_or_else(|| SluiceError::invalid(format!("TPC-H q{number} has no select")))?;
    if let Some(limit) = row_limit(number) {
        statements[result_statement].push_str(&format!("\nlimit {limit}"));
    }
    Ok(TpchQuery {
        number,
        statements,
        result_statement,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_query_is_fully_substituted() {
        for number in QUERY_NUMBERS {
            let query = tpch_query(number, 1.0).unwrap();
            for statement in &query.statements {
                let leftover = statement.match_indices(':').any(|(i, _)| {
                    statement[i + 1..].starts_with(|c: char| c.is_ascii_alphanumeric())
                });
                assert!(!leftover, "q{number} keeps a parameter: {statement}");
            }
        }
    }

    #[test]
    fn q15_is_three_statements_with_the_select_in_the_middle() {
        let query = tpch_query(15, 1.0).unwrap();
        assert_eq!(query.statements.len(), 3);
        assert_eq!(query.result_statement, 1);
        assert!(query.statements[0].starts_with("create view revenue0"));
        assert!(query.statements[2].starts_with("drop view revenue0"));
    }

    #[test]
    fn q11_fraction_follows_the_scale() {
        assert_eq!(q11_fraction(1.0), "0.0001");
        assert_eq!(q11_fraction(0.1), "0.001");
        assert_eq!(q11_fraction(0.01), "0.01");
        assert_eq!(q11_fraction(10.0), "0.00001");
        assert!(tpch_query(11, 0.01).unwrap().statements[0].contains("* 0.01"));
    }

    #[test]
    fn q1_interval_has_no_precision() {
        let q1 = &tpch_query(1, 1.0).unwrap().statements[0];
        assert!(q1.contains("interval '90' day\n"), "{q1}");
    }

    #[test]
    fn limits_follow_the_spec() {
        assert!(tpch_query(3, 1.0).unwrap().statements[0].ends_with("limit 10"));
        assert!(!tpch_query(1, 1.0).unwrap().statements[0].contains("limit"));
    }

    #[test]
    fn multi_digit_parameters_substitute_whole() {
        let q16 = &tpch_query(16, 1.0).unwrap().statements[0];
        assert!(
            q16.contains("p_size in (49, 14, 23, 45, 19, 3, 36, 9)"),
            "{q16}"
        );
    }

    #[test]
    fn unknown_numbers_are_rejected() {
        assert!(tpch_query(0, 1.0).is_err());
        assert!(
            tpch_query(23, 1.0)
                .unwrap_err()
                .to_string()
                .contains("1 to 22")
        );
    }
}
