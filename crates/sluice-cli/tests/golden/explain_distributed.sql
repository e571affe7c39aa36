EXPLAIN DISTRIBUTED
select r_name, count(*) as nations
from nation join region on n_regionkey = r_regionkey
group by r_name order by r_name;
