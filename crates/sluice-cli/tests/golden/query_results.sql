-- Results and row counts read the same in every mode.
select r_name, count(*) as nations
from nation join region on n_regionkey = r_regionkey
group by r_name order by r_name;
select count(*) from lineitem where l_quantity > 45;
