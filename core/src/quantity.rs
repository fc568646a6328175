//! Kubernetes resource quantities (`500m`, `1Gi`, `2`, `1e3`) as exact integers.

use thiserror::Error;

/// Why a quantity string could not be read.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum QuantityError {
    /// Not of the form `<number><suffix>`.
    #[error("not a Kubernetes quantity")]
    Syntax,
    /// The suffix is not one Kubernetes knows.
    #[error("unknown suffix {0:?}")]
    Suffix(String),
    /// Negative amounts make no sense for a request.
    #[error("negative amount")]
    Negative,
    /// Too large to represent.
    #[error("amount out of range")]
    Overflow,
}

/// Nano-units per unit: quantities are held exactly as integer nano-units.
const NANO: i128 = 1_000_000_000;

/// A non-negative quantity held exactly, in nano-units.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Amount {
    nanos: i128,
}

impl Amount {
    /// Parses a Kubernetes quantity string.
    pub fn parse(s: &str) -> Result<Self, QuantityError> {
        let s = s.trim();
        let (sign, body) = match s.as_bytes().first() {
            Some(b'-') => (-1, &s[1..]),
            Some(b'+') => (1, &s[1..]),
            _ => (1, s),
        };
        let num_end = body
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(body.len());
        let (number, suffix) = body.split_at(num_end);
        if number.is_empty() || number == "." || number.matches('.').count() > 1 {
            return Err(QuantityError::Syntax);
        }
        let (int_part, frac_part) = number.split_once('.').unwrap_or((number, ""));
        // Scale: multiply by 10^exp10 * 2^exp2.
        let (exp10, exp2): (i32, u32) = match suffix {
            "" => (0, 0),
            "n" => (-9, 0),
            "u" => (-6, 0),
            "m" => (-3, 0),
            "k" => (3, 0),
            "M" => (6, 0),
            "G" => (9, 0),
            "T" => (12, 0),
            "P" => (15, 0),
            "E" => (18, 0),
            "Ki" => (0, 10),
            "Mi" => (0, 20),
            "Gi" => (0, 30),
            "Ti" => (0, 40),
            "Pi" => (0, 50),
            "Ei" => (0, 60),
            other => {
                let exp = other
                    .strip_prefix(['e', 'E'])
                    .ok_or_else(|| QuantityError::Suffix(other.to_string()))?;
                let e: i32 = exp.parse().map_err(|_| QuantityError::Suffix(other.to_string()))?;
                if !(-30..=30).contains(&e) {
                    return Err(QuantityError::Overflow);
                }
                (e, 0)
            }
        };
        // digits as an integer, with the decimal point folded into exp10.
        let digits: String = format!("{int_part}{frac_part}");
        let digits = digits.trim_start_matches('0');
        if digits.len() > 30 {
            return Err(QuantityError::Overflow);
        }
        let mantissa: i128 = if digits.is_empty() {
            0
        } else {
            digits.parse().map_err(|_| QuantityError::Syntax)?
        };
        let exp = exp10 - frac_part.len() as i32 + 9; // in nano-units
        let mut nanos = mantissa;
        if exp >= 0 {
            for _ in 0..exp {
                nanos = nanos.checked_mul(10).ok_or(QuantityError::Overflow)?;
            }
        } else {
            // Kubernetes rounds sub-nano precision up.
            let div = 10i128.checked_pow((-exp) as u32).ok_or(QuantityError::Overflow)?;
            nanos = nanos.saturating_add(div - 1) / div;
        }
        nanos = nanos.checked_mul(1i128 << exp2).ok_or(QuantityError::Overflow)?;
        if sign < 0 && nanos != 0 {
            return Err(QuantityError::Negative);
        }
        Ok(Self { nanos })
    }

    /// The amount in thousandths, rounded up (CPU millicores).
    pub fn milli_ceil(self) -> u64 {
        // Saturating: an amount near i128's end must not wrap (release) or panic (debug).
        let m = self.nanos.saturating_add(999_999) / 1_000_000;
        u64::try_from(m).unwrap_or(u64::MAX)
    }

    /// The amount rounded up to a whole unit (bytes).
    pub fn ceil(self) -> u64 {
        u64::try_from(self.nanos.saturating_add(NANO - 1) / NANO).unwrap_or(u64::MAX)
    }

    /// The amount as a whole number, or `None` when it has a fractional part.
    pub fn as_integer(self) -> Option<u64> {
        (self.nanos % NANO == 0)
            .then(|| u64::try_from(self.nanos / NANO).ok())
            .flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> Amount {
        Amount::parse(s).unwrap()
    }

    #[test]
    fn parses_the_usual_forms() {
        assert_eq!(p("500m").milli_ceil(), 500);
        assert_eq!(p("2").milli_ceil(), 2000);
        assert_eq!(p("1.5").milli_ceil(), 1500);
        assert_eq!(p("1Gi").ceil(), 1 << 30);
        assert_eq!(p("1.5Gi").ceil(), 3 << 29);
        assert_eq!(p("128974848").ceil(), 128_974_848);
        assert_eq!(p("129e6").ceil(), 129_000_000);
        assert_eq!(p("129M").ceil(), 129_000_000);
        assert_eq!(p("123Mi").ceil(), 123 * 1024 * 1024);
        assert_eq!(p("100").as_integer(), Some(100));
        assert_eq!(p("1k").as_integer(), Some(1000));
        assert_eq!(p("0.5").as_integer(), None);
        assert_eq!(p("1500m").as_integer(), None);
        assert_eq!(p("2000m").as_integer(), Some(2));
        assert_eq!(p("1n").milli_ceil(), 1);
    }

    #[test]
    fn rejects_garbage() {
        assert_eq!(Amount::parse(""), Err(QuantityError::Syntax));
        assert_eq!(Amount::parse("."), Err(QuantityError::Syntax));
        assert_eq!(Amount::parse("1.2.3"), Err(QuantityError::Syntax));
        assert_eq!(Amount::parse("abc"), Err(QuantityError::Syntax));
        assert_eq!(Amount::parse("1Xi"), Err(QuantityError::Suffix("Xi".into())));
        assert_eq!(Amount::parse("-1"), Err(QuantityError::Negative));
        assert_eq!(Amount::parse("1e99"), Err(QuantityError::Overflow));
        assert!(Amount::parse("99999999999999999999999999999999999").is_err());
    }

    #[test]
    fn an_amount_at_the_end_of_the_range_rounds_without_overflow() {
        // 884,105,727 nano-units short of i128::MAX: rounding up to a whole unit used to add
        // past the end (a panic in debug builds, a wrapped, negative amount in release).
        let a = Amount::parse("170141183460469231731687303715").unwrap();
        assert_eq!(a.ceil(), u64::MAX);
        assert_eq!(a.milli_ceil(), u64::MAX);
    }

    proptest::proptest! {
        #[test]
        fn never_panics(s in ".{0,40}") {
            let _ = Amount::parse(&s);
        }

        /// Large, well-formed amounts of every suffix: parsing and every conversion stay
        /// total (the rounding once added past i128's end).
        #[test]
        fn conversions_never_overflow(
            digits in "[1-9][0-9]{0,29}",
            frac in "[0-9]{0,12}",
            suffix in proptest::sample::select(vec!["", "n", "u", "m", "k", "M", "G", "T", "P", "E", "Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "e18", "e-30"]),
        ) {
            let text = if frac.is_empty() { format!("{digits}{suffix}") } else { format!("{digits}.{frac}{suffix}") };
            if let Ok(a) = Amount::parse(&text) {
                let _ = (a.milli_ceil(), a.ceil(), a.as_integer());
            }
        }

        #[test]
        fn integers_round_trip(n in 0u64..1_000_000_000_000) {
            proptest::prop_assert_eq!(Amount::parse(&n.to_string()).unwrap().as_integer(), Some(n));
        }
    }
}
